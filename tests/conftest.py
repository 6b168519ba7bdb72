"""Shared test set-up: no network, GPU tests skipped on CPU, the CPU runtime on demand."""

from __future__ import annotations

import os

import pytest

# No test may reach a model hub; tiny models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason='needs a CUDA GPU (on a GPU machine: make test PYTEST_ARGS="-m gpu")')
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_runtime():
    """The CPU runtime switched on for one test and off afterwards (forced on, so it runs on GPU hosts too)."""
    from qvl.foundation import runtime

    runtime.activate(force=True)
    yield runtime
    runtime.deactivate()


@pytest.fixture
def free_port() -> int:
    from qvl.foundation.distributed import free_port

    return free_port()
