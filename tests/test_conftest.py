"""The suite's own set-up (tests/conftest.py): the cores shared between pytest-xdist workers."""

from __future__ import annotations

import os

import torch

from tests.conftest import threads_per_worker


def test_each_worker_takes_its_share_of_the_cores_unless_told():
    cores = os.cpu_count() or 1
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "2"}) == max(1, cores // 2)
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": str(cores + 1)}) == 1
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}) is None  # the user's
    assert threads_per_worker({}) is None  # one process runs the tests: torch's default
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":  # this worker, and what it starts, took its share
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
