"""Fixtures for the launcher tests: a real single-node Slurm (tests marked `slurm`)."""

from __future__ import annotations

import shutil

import pytest

from tests.launchers.slurm_cluster import SlurmCluster, Unavailable, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Slurm with accounting on this node, for the whole session (~5 s to start once installed); skips with the
    reason where it cannot run (not root, no apt-get, a failed install or daemon)."""
    try:
        cluster = start_cluster()
    except Unavailable as why:
        pytest.skip(f"no real Slurm here: {why}")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", str(cluster.conf))  # sbatch/sacct run by NeMo-Run in this process find it
            yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
