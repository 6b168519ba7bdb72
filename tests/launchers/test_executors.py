"""Executor factories: each returns a plain NeMo-Run executor with qvl's defaults, and nothing contacts a cluster."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import nemo_run as run
import pytest
from nemo_run.core.execution.launcher import Torchrun

from qvl.foundation.errors import LaunchError
from qvl.launchers import executors

FAKE_KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: fake, cluster: {server: "https://127.0.0.1:6443"}}]
contexts: [{name: fake, context: {cluster: fake, user: fake}}]
current-context: fake
users: [{name: fake, user: {}}]
"""


@pytest.fixture
def fake_kubeconfig(tmp_path, monkeypatch):
    """A kubeconfig pointing nowhere: KubeflowExecutor loads it when built and never connects in these tests."""
    path = tmp_path / "kubeconfig"
    path.write_text(FAKE_KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(path))
    # The kubernetes client reads $KUBECONFIG once, when imported.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path


def test_local_without_gpus_uses_the_cpu_runtime():
    executor = executors.local(gpus=0)
    assert isinstance(executor, run.LocalExecutor)
    assert executor.launcher is None and executor.ntasks_per_node == 1
    assert executors.is_cpu(executor)
    assert executors.world_shape(executor) == (1, 1)


def test_local_cpu_processes_use_torchrun():
    executor = executors.local(gpus=0, cpu_processes=2)
    assert isinstance(executor.launcher, Torchrun) and executor.ntasks_per_node == 2
    assert executors.is_cpu(executor)


def test_local_with_gpus_runs_torchrun_per_gpu():
    executor = executors.local(gpus=4, env_vars={"EXTRA": "1"})
    assert isinstance(executor.launcher, Torchrun)
    assert executor.ntasks_per_node == 4 and not executors.is_cpu(executor)
    assert executor.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and executor.env_vars["EXTRA"] == "1"


def test_slurm_sets_container_requeue_torchrun_and_megatron_env():
    executor = executors.slurm(
        account="acct",
        partition="batch",
        container_image="nvcr.io/nvidia/nemo:25.09",
        nodes=2,
        mounts=["/lustre/data:/data"],
        job_dir="/lustre/qvl",
        qos="high",
    )
    assert isinstance(executor, run.SlurmExecutor)
    assert (executor.account, executor.partition, executor.nodes, executor.gpus_per_node) == ("acct", "batch", 2, 8)
    assert executor.container_image == "nvcr.io/nvidia/nemo:25.09" and executor.container_mounts == [
        "/lustre/data:/data"
    ]
    assert isinstance(executor.launcher, Torchrun) and executor.retries == 2 and executor.exclusive is True
    assert isinstance(executor.tunnel, run.LocalTunnel) and executor.tunnel.job_dir == "/lustre/qvl"
    assert executor.qos == "high"  # other keywords reach the SlurmExecutor
    assert executor.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert executors.world_shape(executor) == (2, 8)


def test_slurm_with_host_uses_an_ssh_tunnel():
    executor = executors.slurm(
        account="a", partition="p", container_image="img", host="login.example.com", user="me", job_dir="/lustre/me/qvl"
    )
    assert isinstance(executor.tunnel, run.SSHTunnel)
    assert (executor.tunnel.host, executor.tunnel.user, executor.tunnel.job_dir) == (
        "login.example.com",
        "me",
        "/lustre/me/qvl",
    )


def test_slurm_requires_account_partition_and_image():
    with pytest.raises(TypeError, match="account"):
        executors.slurm(partition="p", container_image="img")


def test_kubernetes_builds_a_trainjob_executor_with_pvcs(fake_kubeconfig):
    from nemo_run.core.execution.kubeflow import KubeflowExecutor

    executor = executors.kubernetes(
        image="nvcr.io/nvidia/nemo:25.09",
        nodes=4,
        gpus_per_node=8,
        data_pvc="qvl-data",
        checkpoints_pvc="qvl-ckpt",
        namespace="ml",
        package_qvl=False,  # an image that has qvl: no workdir PVC needed
    )
    assert isinstance(executor, KubeflowExecutor)
    assert (executor.num_nodes, executor.gpus_per_node, executor.namespace) == (4, 8, "ml")
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in executor.volumes}
    assert claims == {"dshm": None, "data": "qvl-data", "checkpoints": "qvl-ckpt"}
    assert {m["mountPath"] for m in executor.volume_mounts} == {"/dev/shm", "/data", "/checkpoints"}
    assert executor.launcher is None  # the TrainJob runtime hands torchrun its topology
    assert executors.world_shape(executor) == (4, 8)


def test_every_megatron_env_var_says_why():
    source = inspect.getsource(executors).split("MEGATRON_ENV", 1)[1].split("}", 1)[0]
    lines = source.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r'\s+"(\w+)":', line)
        if match:
            assert lines[i - 1].strip().startswith("#"), f"{match.group(1)} has no comment saying why"
    assert set(re.findall(r'"(\w+)":', source)) == set(executors.MEGATRON_ENV)


def test_slurm_job_brings_the_qvl_source_with_it(tmp_path):
    """A stock NeMo container has no qvl: the job's code folder (the container's working directory) gets the qvl
    source of this process as `qvl/<folder>`, and `python -m` there imports it from that folder."""
    import subprocess
    import sys
    import tarfile

    executor = executors.slurm(account="a", partition="p", container_image="img")
    assert isinstance(executor.packager, executors.QvlSourcePackager)
    archive = executor.packager.package(tmp_path, str(tmp_path / "job"), "train")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "code", filter="data")
    assert "qvl/launchers/cli.py" in names and "qvl/recipes/overrides.py" in names
    assert not any("__pycache__" in n for n in names)
    found = subprocess.run(
        [sys.executable, "-c", "import qvl.recipes.overrides as m; print(m.__file__)"],
        cwd=tmp_path / "code", capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert found == str(tmp_path / "code" / "qvl" / "recipes" / "overrides.py")
    plain = executors.slurm(account="a", partition="p", container_image="img", package_qvl=False)
    assert type(plain.packager) is run.Packager  # an image that already has qvl


def test_kubernetes_job_brings_the_qvl_source_through_the_workdir_pvc(fake_kubeconfig, tmp_path):
    """NeMo-Run copies `workdir_local_path` into the job's code folder on the workdir PVC and its launch script links
    /nemo_run to that folder: with PYTHONPATH=/nemo_run the pods import the qvl this process runs."""
    import subprocess
    import sys

    executor = executors.kubernetes(image="img", workdir_pvc="qvl-work")
    assert (executor.workdir_pvc, executor.workdir_pvc_path) == ("qvl-work", executors.WORKDIR_MOUNT)
    assert executor.env_vars["PYTHONPATH"] == executors.POD_CODE_LINK
    assert {"name": "workdir", "mountPath": executors.WORKDIR_MOUNT} in executor.volume_mounts
    staged = Path(executor.workdir_local_path)
    assert (staged / "qvl" / "launchers" / "cli.py").is_file() and not list(staged.rglob("__pycache__"))
    code_link = tmp_path / "nemo_run"  # what launch.sh's `ln -sfn CODE_DIR /nemo_run` makes in the pod
    code_link.symlink_to(staged)
    found = subprocess.run(
        [sys.executable, "-c", "import qvl.recipes.overrides as m; print(m.__file__)"],
        env={**os.environ, "PYTHONPATH": str(code_link)}, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert found == str(code_link / "qvl" / "recipes" / "overrides.py")
    with pytest.raises(LaunchError, match="set workdir_pvc=CLAIM .* or package_qvl=false"):
        executors.kubernetes(image="img")
