"""Executor factories: where a qvl run executes, as NeMo-Run executors (this machine, Slurm, Kubernetes).

Each factory is a small function of keyword arguments with defaults for a typical 8-GPU node and
returns a plain NeMo-Run executor, so anything NeMo-Run offers stays reachable by setting a field on the
result. qvl adds no scheduler, job runner or SSH code: submission, tunnels, requeueing and logs are
NeMo-Run's. A job brings the qvl source of the submitting process with it into a stock NeMo container: on
Slurm as a package NeMo-Run extracts into the job's code folder (`QvlSourcePackager`), on Kubernetes through
NeMo-Run's workdir PVC. The task is the `qvl` command line (see `launch.py`).
"""

import atexit
import dataclasses
import functools
import importlib
import inspect
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

import nemo_run as run
from nemo_run.core.execution.kubeflow import KubeflowExecutor
from nemo_run.core.execution.launcher import Torchrun

from qvl.foundation.errors import LaunchError

# Set on a LocalExecutor that runs on the CPU runtime; the task then gets `--device cpu`.
CPU_DEVICE_ENV = "QVL_DEVICE"

# What a Megatron job needs in its environment on any GPU cluster.
MEGATRON_ENV: dict[str, str] = {
    # Megatron overlaps TP/CP communication with compute by issuing kernels in a fixed order; with more
    # than one hardware queue the GPU may reorder them and the overlap (or the result) breaks.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # NCCL's NVLink-SHARP buffers take ~1 GiB per communicator and Megatron creates one per parallel group.
    "NCCL_NVLS_ENABLE": "0",
    # Frees communication buffers when the collective ends instead of when the caching allocator notices,
    # which lowers peak memory under communication overlap.
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    # NCCL warnings and errors (not its INFO chatter) in the job log, so a hang or IB fault says why.
    "NCCL_DEBUG": "WARN",
    # HF tokenizers' thread pool deadlocks in forked dataloader workers.
    "TOKENIZERS_PARALLELISM": "false",
}

# Fields no site file may hold: tokens come from the environment or the kubeconfig, never from YAML.
SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey", "credential")


def visible_gpus() -> int:
    """GPUs this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local(
    *, gpus: Optional[int] = None, cpu_processes: int = 1, env_vars: Optional[dict[str, str]] = None
) -> run.LocalExecutor:
    """This machine: torchrun over the visible GPUs, or the CPU runtime when there are none."""
    gpus = visible_gpus() if gpus is None else gpus
    extra = _interpreter_on_path() | dict(env_vars or {})
    if gpus > 0:
        return run.LocalExecutor(ntasks_per_node=gpus, launcher=Torchrun(), env_vars=MEGATRON_ENV | extra)
    # One CPU process needs no torchrun; the CPU runtime makes a world of one with gloo.
    launcher = Torchrun() if cpu_processes > 1 else None
    return run.LocalExecutor(
        ntasks_per_node=cpu_processes,
        launcher=launcher,
        env_vars={CPU_DEVICE_ENV: "cpu", "TOKENIZERS_PARALLELISM": "false"} | extra,
    )


def _interpreter_on_path() -> dict[str, str]:
    """PATH with this interpreter's bin/ first, where it is missing (a venv used without activating it):
    NeMo-Run starts local jobs as `python ...` / `torchrun ...` looked up on PATH."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    return {} if bindir in path.split(os.pathsep) else {"PATH": os.pathsep.join([bindir, path])}


# The folders that make up the `qvl` package (pyproject's package-dir: each is `qvl.<folder>`).
QVL_FOLDERS = ("foundation", "bridges", "data", "recipes", "launchers")


@dataclasses.dataclass(kw_only=True)
class QvlSourcePackager(run.Packager):
    """Packs the qvl source this process runs as `qvl/<folder>/...`, so a job brings the same qvl with it.

    NeMo-Run extracts it into the job's code folder, which is the container's working directory
    (`/nemo_run/code`); `torchrun -m qvl.launchers.cli` puts the working directory first on sys.path, so the
    job imports this qvl without installing anything and without touching the image's Megatron stack. `qvl` is
    a namespace package, so a qvl already in the image is shadowed folder by folder, never mixed in."""

    def package(self, path: Path, job_dir: str, name: str) -> str:
        """Write `JOB_DIR/NAME.tar.gz` and return its path (`path`, NeMo-Run's working copy, is not used)."""
        output = Path(job_dir) / f"{name}.tar.gz"
        output.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(output, "w:gz") as tar:
            tar.add(Path(stage_qvl_source()) / "qvl", arcname="qvl")
        return str(output)


def slurm(
    *,
    account: str,
    partition: str,
    container_image: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    time: str = "04:00:00",
    mounts: Optional[list[str]] = None,
    job_dir: str = "",
    host: str = "",
    user: str = "",
    identity: str = "",
    retries: int = 2,
    exclusive: bool = True,
    env_vars: Optional[dict[str, str]] = None,
    package_qvl: bool = True,
    **sbatch: Any,
) -> run.SlurmExecutor:
    """A Slurm cluster with pyxis/enroot: one torchrun per node in `container_image`, requeued on failure.

    `host` submits over SSH (NeMo-Run's SSHTunnel; keys from your ssh-agent or `identity`); without it
    sbatch runs on this machine (a login node). `job_dir` is where experiments live on the cluster's shared
    filesystem. `mounts` are pyxis `src:dst` pairs. Other keywords are SlurmExecutor fields (qos, mem, ...).
    `package_qvl` (default) sends the qvl source this process runs with the job (QvlSourcePackager); turn it
    off for an image that already has the qvl you want.
    """
    if host:
        tunnel = run.SSHTunnel(
            host=host, user=user or os.environ.get("USER", ""), job_dir=job_dir, identity=identity or None
        )
    else:
        tunnel = run.LocalTunnel(job_dir=job_dir)
    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        # torchrun starts the per-GPU workers, so Slurm starts one task per node.
        ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        time=time,
        container_image=container_image,
        container_mounts=list(mounts or []),
        # Whole nodes: NVLink topology and NCCL rings assume no other job shares the GPUs.
        exclusive=exclusive or None,
        job_name_prefix="qvl-",
        tunnel=tunnel,
        packager=QvlSourcePackager() if package_qvl else run.Packager(),
        launcher=Torchrun(),
        # On failure the sbatch script requeues the job (`scontrol requeue`) up to this many times;
        # training resumes from its last checkpoint.
        retries=retries,
        env_vars=MEGATRON_ENV | dict(env_vars or {}),
        **sbatch,
    )


def _pvc_volumes(claims) -> tuple[list[dict], list[dict]]:
    """Pod volumes and mounts for (name, claim, mount path) triples whose claim is set."""
    volumes, mounts = [], []
    for name, claim, path in claims:
        if claim:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
            mounts.append({"name": name, "mountPath": path})
    return volumes, mounts


def kubernetes(
    *,
    image: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    namespace: str = "default",
    data_pvc: str = "",
    data_path: str = "/data",
    checkpoints_pvc: str = "",
    checkpoints_path: str = "/checkpoints",
    shm_size: str = "64Gi",
    runtime: str = "torch-distributed",
    env_vars: Optional[dict[str, str]] = None,
    package_qvl: bool = True,
    workdir_pvc: str = "",
    **fields: Any,
) -> run.Executor:
    """A Kubeflow Trainer v2 TrainJob: `nodes` pods of `gpus_per_node` GPUs, data and checkpoints on PVCs.

    Needs a kubeconfig (or an in-cluster service account) when built; no token belongs here. Other
    keywords are KubeflowExecutor fields (tolerations, affinity, labels, ...). `package_qvl` (default) brings the
    qvl source this process runs with the job through NeMo-Run's workdir PVC (`workdir_pvc`, a ReadWriteMany
    claim); turn it off for an image that already has the qvl you want.
    """
    return _kubeflow(
        KubeflowExecutor,
        image=image,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        namespace=namespace,
        data_pvc=data_pvc,
        data_path=data_path,
        checkpoints_pvc=checkpoints_pvc,
        checkpoints_path=checkpoints_path,
        shm_size=shm_size,
        runtime=runtime,
        env_vars=env_vars,
        package_qvl=package_qvl,
        workdir_pvc=workdir_pvc,
        **fields,
    )


def kubernetes_manifest_only(**settings: Any) -> run.Executor:
    """The `kubernetes` executor for a dry run: it renders the same TrainJob without loading a kubeconfig."""
    params = inspect.signature(kubernetes).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
    return _kubeflow(_manifest_only, **(defaults | settings))


def _manifest_only(**fields: Any) -> KubeflowExecutor:
    # KubeflowExecutor.__post_init__ loads the kubeconfig through self._load_kube_clients(), and NeMo-Run rebuilds
    # the executor (`clone()`) when a task is added. Attributes of this one instance answer both calls instead, so
    # neither the class nor NeMo-Run changes; NeMo-Run maps executors by their exact class, so no subclass either.
    executor = KubeflowExecutor.__new__(KubeflowExecutor)
    executor._load_kube_clients = lambda: None
    executor.__init__(**fields)
    del executor._load_kube_clients
    executor.clone = lambda: _manifest_only(**{f.name: getattr(executor, f.name) for f in _init_fields(executor)})
    return executor


def _init_fields(executor: KubeflowExecutor) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(executor) if f.init]


def _kubeflow(
    cls: Any,
    *,
    image: str,
    nodes: int,
    gpus_per_node: int,
    namespace: str,
    data_pvc: str,
    data_path: str,
    checkpoints_pvc: str,
    checkpoints_path: str,
    shm_size: str,
    runtime: str,
    env_vars: Optional[dict[str, str]],
    package_qvl: bool,
    workdir_pvc: str,
    **fields: Any,
) -> run.Executor:
    volumes, mounts = _pvc_volumes((("data", data_pvc, data_path), ("checkpoints", checkpoints_pvc, checkpoints_path)))
    # NCCL and the dataloader workers exchange tensors through /dev/shm; a pod's default is 64 MiB.
    volumes.insert(0, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
    mounts.insert(0, {"name": "dshm", "mountPath": "/dev/shm"})
    env = dict(env_vars or {})
    if package_qvl:
        fields |= _workdir_with_qvl(workdir_pvc, volumes, mounts, env)
    elif workdir_pvc:
        fields["workdir_pvc"] = workdir_pvc
    return cls(
        image=image,
        num_nodes=nodes,
        gpus_per_node=gpus_per_node,
        namespace=namespace,
        runtime_ref=runtime,
        volumes=volumes,
        volume_mounts=mounts,
        packager=run.Packager(),
        # No NeMo-Run launcher: the TrainJob's torch runtime sets PET_NNODES, PET_NPROC_PER_NODE,
        # PET_NODE_RANK and PET_MASTER_ADDR, which torchrun reads; the task command starts torchrun itself.
        launcher=None,
        env_vars=MEGATRON_ENV | env,
        **fields,
    )


# Where the job's code folder appears in the pod. NeMo-Run's launch script links `/nemo_run` to the job's code
# folder on the workdir PVC, so the PVC itself is mounted elsewhere (mounted at /nemo_run, the link would land
# inside it).
WORKDIR_MOUNT = "/qvl-workdir"
POD_CODE_LINK = "/nemo_run"


def _workdir_with_qvl(workdir_pvc: str, volumes: list[dict], mounts: list[dict], env: dict[str, str]) -> dict:
    """KubeflowExecutor fields that ship the qvl source through NeMo-Run's workdir PVC.

    NeMo-Run copies `workdir_local_path` into the job folder, syncs that to the PVC and runs the job through a
    launch script there, which links /nemo_run to it: with PYTHONPATH=/nemo_run every rank imports the qvl it
    brought (nothing installed; the image's Megatron stack untouched)."""
    if not workdir_pvc:
        raise LaunchError(
            "the kubernetes executor brings qvl with the job through NeMo-Run's workdir PVC: set workdir_pvc=CLAIM "
            "(a ReadWriteMany PVC; run.executor.workdir_pvc=... or the site file's kubernetes: section), or "
            "package_qvl=false for an image that already has qvl"
        )
    volumes.append({"name": "workdir", "persistentVolumeClaim": {"claimName": workdir_pvc}})
    mounts.append({"name": "workdir", "mountPath": WORKDIR_MOUNT})
    env["PYTHONPATH"] = POD_CODE_LINK
    return {"workdir_pvc": workdir_pvc, "workdir_pvc_path": WORKDIR_MOUNT, "workdir_local_path": stage_qvl_source()}


@functools.lru_cache(maxsize=1)
def stage_qvl_source() -> str:
    """A folder holding the qvl source this process runs, as `qvl/<folder>/...` (what a job imports); made once per
    process, since NeMo-Run builds an executor several times per launch (validation, dry run, clone)."""
    root = Path(importlib.import_module("qvl.launchers").__file__).parent.parent
    stage = Path(tempfile.mkdtemp(prefix="qvl-source-"))
    atexit.register(shutil.rmtree, stage, ignore_errors=True)  # NeMo-Run copies it at submission, in this process
    for folder in QVL_FOLDERS:
        shutil.copytree(root / folder, stage / "qvl" / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return str(stage)


FACTORIES = {"local": local, "slurm": slurm, "kubernetes": kubernetes}
# Executor fields a factory sets itself; the other fields pass through its **keywords.
_SET_BY_FACTORY = {
    "slurm": {"ntasks_per_node", "container_mounts", "job_name_prefix", "tunnel", "packager", "launcher"},
    "kubernetes": {
        "num_nodes",
        "runtime_ref",
        "volumes",
        "volume_mounts",
        "packager",
        "launcher",
        "workdir_pvc_path",
        "workdir_local_path",
    },
}


def factory_settings(kind: str) -> list[str]:
    """Every keyword the `kind` factory accepts: its own and, for slurm/kubernetes, the executor's other fields."""
    factory = FACTORIES[kind]
    own = [n for n, p in inspect.signature(factory).parameters.items() if p.kind is not p.VAR_KEYWORD]
    if kind == "local":
        return own
    if kind == "slurm":
        cls = run.SlurmExecutor
    else:
        cls = KubeflowExecutor
    passthrough = {f.name for f in dataclasses.fields(cls) if f.init} - _SET_BY_FACTORY[kind]
    return own + sorted(passthrough - set(own))


def is_cpu(executor: run.Executor) -> bool:
    """Whether `executor` runs the job on the CPU runtime."""
    return isinstance(executor, run.LocalExecutor) and executor.env_vars.get(CPU_DEVICE_ENV) == "cpu"


def world_shape(executor: run.Executor) -> tuple[int, int]:
    """(nodes, processes per node) the executor will start."""
    if isinstance(executor, run.SlurmExecutor):
        return executor.nodes, executor.torchrun_nproc_per_node or executor.gpus_per_node or executor.ntasks_per_node
    return executor.nnodes(), executor.nproc_per_node()
