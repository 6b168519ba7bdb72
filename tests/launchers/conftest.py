"""Fixtures for the launcher tests: real Slurm clusters (tests marked `slurm`; the two-node one also `multinode`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.launchers.slurm_cluster import (
    Munge,
    SlurmCluster,
    Unavailable,
    install_ahead,
    start_cluster,
    start_two_node_cluster,
)


def pytest_collection_finish(session):
    """Where Slurm tests are selected and Slurm is not installed yet, its packages install while earlier tests run."""
    marked = [item for item in session.items if "slurm" in item.keywords]
    if marked:
        install_ahead(two_nodes=any("multinode" in item.keywords for item in marked))


@pytest.fixture(scope="session")
def munge_daemon() -> Munge:
    """The machine's one munged, shared by every cluster of the session; skips where Slurm cannot run here."""
    root = Path(tempfile.mkdtemp(prefix="qvl-munge-"))
    try:
        munge = Munge(root).start()
    except Unavailable as why:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no real Slurm here: {why}")
    try:
        yield munge
    finally:
        munge.stop()
        shutil.rmtree(root, ignore_errors=True)


def _serve(start, munge: Munge):
    try:
        cluster = start(munge)
    except Unavailable as why:
        pytest.skip(f"no real Slurm here: {why}")
    try:
        # Not SLURM_CONF for the whole session: both clusters may be up at once; each test module points its
        # tests at its own (`cluster.env`, SLURM_CONF).
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster(munge_daemon) -> SlurmCluster:
    """Slurm with accounting on this node, for the whole session (~5 s to start once installed)."""
    yield from _serve(start_cluster, munge_daemon)


@pytest.fixture(scope="session")
def two_node_cluster(munge_daemon) -> SlurmCluster:
    """Slurm with two nodes, `node1` and `node2`, each in a network namespace of its own (~12 s to start)."""
    yield from _serve(start_two_node_cluster, munge_daemon)
