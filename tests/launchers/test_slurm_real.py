"""qvl on a real Slurm (the `slurm_cluster` fixture: one node, this machine as it is, CPU partition, no containers,
accounting on): what goes wrong before a job trains. A job that fails in the queue, a request sbatch refuses and a
container image on a cluster without pyxis each end in one `error:` line and exit status 2. Training on Slurm (both
launch paths, one and two processes per node, requeue and resume, a failing rank, Ray) runs on the two-node cluster
in test_slurm_multinode.py. Selected with `-m slurm`.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

QVL = str(Path(sys.executable).with_name("qvl"))
# A CPU partition without pyxis: what docs/launching.md's bare-Slurm example shows.
CPU_SITE = "slurm:\n  account: qvl\n  partition: cpu\n  gpus_per_node: 0\n  exclusive: false\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The CPU site file, in a folder of the module's own."""
    root = tmp_path_factory.mktemp("slurm-inputs")
    site = root / "site.yaml"
    site.write_text(CPU_SITE)
    return {"site": site, "root": root}


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch, slurm_cluster):
    """NeMo-Run runs sbatch through invoke, which reads stdin; pytest's stdin refuses reads. sbatch and sacct run
    in this process reach the one-node cluster."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))


def _job_env(cluster) -> dict[str, str]:
    return os.environ | cluster.env | {"COLUMNS": "200", "NO_COLOR": "1"}


def _job_ids(cluster, name_part: str) -> list[str]:
    rows = cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID,JobName"]).stdout.split()
    return [row.split("|")[0] for row in rows if name_part in row]


def test_a_job_that_fails_in_the_queue_is_reported_as_failed(slurm_cluster, inputs):
    folder = inputs["root"] / "exp-fail"
    done = subprocess.run(
        [QVL, "launch", "demo", "steps=2", "output=/proc/qvl-cannot-write", "run.executor.retries=0", "--executor",
         "slurm", "--executor-config", str(inputs["site"]), "--experiments-dir", str(folder), "--wait"],
        env=_job_env(slurm_cluster), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), done.stderr
    assert "FAILED" in errors[0] and "log" in errors[0], errors[0]


def test_sbatch_refusing_the_request_is_one_error_line(slurm_cluster, inputs, capsys):
    """A request qvl does not check itself (a node feature this cluster has not got) ends in sbatch's own words."""
    from qvl.launchers.cli import main

    code = main(
        ["launch", "demo", "steps=2", "run.executor.constraint=no-such-feature", "--executor", "slurm",
         "--executor-config", str(inputs["site"]), "--experiments-dir", str(inputs["root"] / "exp-refused")]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: sbatch refused") and "invalid feature" in err[0].lower(), err


def test_a_container_image_on_a_cluster_without_pyxis_is_refused_before_submission(slurm_cluster, inputs, capsys):
    from qvl.launchers.cli import main

    before = _job_ids(slurm_cluster, "")
    code = main(
        ["launch", "demo", "steps=2", "run.executor.container_image=nvcr.io/nvidia/nemo:25.09", "--executor",
         "slurm", "--executor-config", str(inputs["site"]), "--experiments-dir", str(inputs["root"] / "exp-img")]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "pyxis" in err[0] and "container_image" in err[0], err
    assert _job_ids(slurm_cluster, "") == before  # nothing reached the queue
