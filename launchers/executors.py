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
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

from qvl.foundation.megatron import gc_paused

with gc_paused():  # NeMo-Run imports torch, Kubernetes' and Lepton's clients: most of a dry run's CPU
    import nemo_run as run
    from nemo_run.core.execution.kubeflow import KubeflowExecutor
    from nemo_run.core.execution.launcher import Torchrun

from qvl.foundation import FOLDERS
from qvl.foundation.errors import LaunchError
from qvl.foundation.rendezvous import RULES, SLURM_PORT_BASE, SLURM_PORT_SPAN, slurm_exports
from qvl.kernels.fix_kubeflow_v2_2 import RUNTIME_PATCHES

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

# torchrun's c10d store on a Slurm job's first node listens on the rule's MASTER_PORT (exported by the batch
# script), not NeMo-Run's fixed 29500, which two jobs sharing a node would both bind. NeMo-Run writes it unquoted.
RDZV_PORT: Any = "$MASTER_PORT"

# Fields no site file may hold: tokens come from the environment or the kubeconfig, never from YAML.
SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey", "credential")
# Settings that name Kubernetes Secrets rather than hold one: `image_pull_secrets: [ngc-secret]` lists Secret
# names, which every pod pulling from nvcr.io needs.
SECRET_NAMES = ("image_pull_secrets",)


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


def _interpreter_on_path(always: bool = False) -> dict[str, str]:
    """PATH with this interpreter's bin/ first, where it is missing (a venv used without activating it), or
    `always` (a Slurm job: the compute node's PATH is not this shell's): NeMo-Run starts jobs as `python ...` /
    `torchrun ...` looked up on PATH."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if not always and bindir in path.split(os.pathsep):
        return {}
    return {"PATH": os.pathsep.join([bindir, "$PATH" if always else path])}


# The folders that make up the `qvl` package (pyproject's package-dir: each is `qvl.<folder>`).


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
    container_image: Optional[str] = None,
    nodes: int = 1,
    gpus_per_node: int = 8,
    processes_per_node: int = 1,
    time: str = "04:00:00",
    mounts: Optional[list[str]] = None,
    job_dir: str = "",
    host: str = "",
    user: str = "",
    identity: str = "",
    retries: int = 2,
    exclusive: bool = True,
    env_vars: Optional[dict[str, str]] = None,
    pass_env: Optional[list[str]] = None,
    package_qvl: bool = True,
    **sbatch: Any,
) -> run.SlurmExecutor:
    """A Slurm cluster: one torchrun per node, in `container_image` (pyxis/enroot) or without one, requeued on failure.

    Without `container_image` the job runs this Python environment's interpreter (its path must exist on the
    compute nodes: a shared filesystem) in the job's code folder. `gpus_per_node: 0` is a CPU partition: no GPU
    request, `processes_per_node` processes per node (torchrun when more than one) on qvl's CPU runtime.
    `host` submits over SSH (NeMo-Run's SSHTunnel; keys from your ssh-agent or `identity`), and `job_dir` is then
    the experiments folder on the cluster's shared filesystem; without `host`, sbatch runs on this machine and
    `job_dir`, if set, is the experiments folder here (the same as `qvl launch --experiments-dir`). `mounts` are
    pyxis `src:dst` pairs. The job's environment is the compute node's login environment, the submitting shell's
    PATH, `env_vars`, and what qvl sets (QVL_DEVICE or MEGATRON_ENV, MASTER_ADDR/MASTER_PORT, SLURM_EXPORT_ENV=ALL,
    this environment's bin/ first on PATH without a container); nothing else of the submitting shell reaches it
    unless named in `pass_env` (e.g. `[WANDB_API_KEY]`: sbatch copies the value, never written into the script).
    Other keywords are SlurmExecutor fields (qos, mem, ...). `package_qvl` (default) sends the qvl source this
    process runs with the job (QvlSourcePackager); turn it off for an image that already has the qvl you want.

    Example (a CPU partition without containers)::

        executor = slurm(account="ml", partition="cpu", gpus_per_node=0, exclusive=False)
    """
    image = container_image or None  # "" and null (YAML) both mean "no container"
    if mounts and not image:
        raise LaunchError(
            f"mounts={list(mounts)} are pyxis container mounts, but no container_image is set: without a "
            "container the job sees the compute node's filesystem as it is; drop mounts or set container_image"
        )
    if gpus_per_node < 0 or processes_per_node < 1:
        raise LaunchError(
            f"gpus_per_node={gpus_per_node}, processes_per_node={processes_per_node}: use gpus_per_node >= 0 "
            "(0 for a CPU partition) and processes_per_node >= 1"
        )
    cpu = gpus_per_node == 0
    env = {CPU_DEVICE_ENV: "cpu", "TOKENIZERS_PARALLELISM": "false"} if cpu else dict(MEGATRON_ENV)
    # Where the ranks meet (qvl.foundation.rendezvous): the first node and a port derived from the job id, the
    # same for srun-started ranks and for torchrun's c10d store.
    env |= slurm_exports()
    # sbatch hands the job only PATH and the named variables (plus SLURM_*); the job's steps then take the batch
    # script's environment, exports included (sbatch's --export would otherwise be inherited by every srun).
    env["SLURM_EXPORT_ENV"] = "ALL"
    sbatch["additional_parameters"] = {"export": _export_list(pass_env)} | dict(
        sbatch.get("additional_parameters") or {}
    )
    if not image:  # this environment's `python` and `torchrun` first on PATH in the job
        env |= _interpreter_on_path(always=True)
    per_node = processes_per_node if cpu else gpus_per_node
    if cpu and processes_per_node > 1:  # torchrun's processes share one Slurm task: give it a core each
        sbatch.setdefault("cpus_per_task", processes_per_node)
    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        # Processes per node; with torchrun NeMo-Run turns this into one Slurm task running that many workers.
        ntasks_per_node=per_node,
        gpus_per_node=None if cpu else gpus_per_node,
        time=time,
        container_image=image,
        container_mounts=list(mounts or []),
        # Whole nodes: NVLink topology and NCCL rings assume no other job shares the GPUs.
        exclusive=exclusive or None,
        job_name_prefix="qvl-",
        tunnel=_tunnel(host=host, user=user, job_dir=job_dir, identity=identity),
        packager=QvlSourcePackager() if package_qvl else run.Packager(),
        # One CPU process needs no torchrun: the CPU runtime makes a world of one.
        launcher=None if per_node == 1 and cpu else Torchrun(rdzv_port=RDZV_PORT),
        # On failure the sbatch script requeues the job (`scontrol requeue`) up to this many times;
        # training resumes from its last checkpoint.
        retries=retries,
        env_vars=env | dict(env_vars or {}),
        **sbatch,
    )


def _export_list(names: Optional[list[str]]) -> str:
    """sbatch's --export: PATH (NeMo-Run's first srun runs `hostname` found on it) and the named variables."""
    names = list(names or [])
    bad = [name for name in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name))]
    if bad:
        raise LaunchError(
            f"pass_env={names}: {', '.join(map(str, bad))} is not a variable name; list names only (the values come "
            "from the submitting shell), e.g. pass_env: [WANDB_API_KEY, HF_TOKEN], and put fixed values in env_vars"
        )
    return ",".join(dict.fromkeys(["PATH", *names]))


def _tunnel(*, host: str, user: str, job_dir: str, identity: str) -> run.SSHTunnel | run.LocalTunnel:
    """SSH to `host` when given (keys from the ssh-agent or `identity`), else sbatch on this machine."""
    if host:
        return run.SSHTunnel(
            host=host, user=user or os.environ.get("USER", ""), job_dir=job_dir, identity=identity or None
        )
    return run.LocalTunnel(job_dir=job_dir)


def _pvc_volumes(claims) -> tuple[list[dict], list[dict]]:
    """Pod volumes and mounts for (name, claim, mount path) triples whose claim is set."""
    volumes, mounts = [], []
    for name, claim, path in claims:
        if claim:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
            mounts.append({"name": name, "mountPath": path})
    return volumes, mounts


@dataclasses.dataclass(kw_only=True)
class KubernetesSite:
    """A Kubernetes site's settings for a Kubeflow Trainer TrainJob (the site file's `kubernetes:` section).

    `trainer_api` is the Kubeflow Trainer release the cluster runs: "v2.2+" (v2.2.0, March 2026, and later) takes
    pod settings (volumes, mounts, tolerations, image pull secrets) as `spec.runtimePatches`; "v2.1" as
    `spec.podTemplateOverrides`. A server drops the field it does not know, so the wrong one starts pods without
    their volumes."""

    image: str
    nodes: int = 1
    gpus_per_node: int = 8
    namespace: str = "default"
    data_pvc: str = ""
    data_path: str = "/data"
    checkpoints_pvc: str = ""
    checkpoints_path: str = "/checkpoints"
    shm_size: str = "64Gi"
    runtime: str = "torch-distributed"
    trainer_api: str = "v2.2+"
    env_vars: Optional[dict[str, str]] = None
    package_qvl: bool = True
    workdir_pvc: str = ""


TRAINER_APIS = ("v2.1", "v2.2+")


def kubernetes(**settings: Any) -> run.Executor:
    """A Kubeflow Trainer v2 TrainJob: `nodes` pods of `gpus_per_node` GPUs, data and checkpoints on PVCs.

    Takes KubernetesSite's settings; other keywords are KubeflowExecutor fields (tolerations, affinity, labels,
    image_pull_secrets, ...). Needs a kubeconfig (or an in-cluster service account) when built; no token belongs
    here. `package_qvl` (default) brings the qvl source this process runs with the job through NeMo-Run's workdir
    PVC (`workdir_pvc`, a ReadWriteMany claim); turn it off for an image that already has the qvl you want.

    Example::

        executor = kubernetes(image="nvcr.io/nvidia/nemo:25.09", nodes=2, workdir_pvc="qvl-work",
                              image_pull_secrets=["ngc-secret"])
    """
    return _kubeflow(KubeflowExecutor, **settings)


# `kubernetes(image=..., nodes=..., ...)`: its keywords are KubernetesSite's, for `--executor-config` checks,
# NeMo-Run's `run.executor.<field>=` parsing and help.
kubernetes.__signature__ = inspect.Signature(
    [
        *inspect.signature(KubernetesSite).parameters.values(),
        inspect.Parameter("fields", inspect.Parameter.VAR_KEYWORD),
    ],
    return_annotation=run.Executor,
)


def kubernetes_manifest_only(**settings: Any) -> run.Executor:
    """The `kubernetes` executor for a dry run: it renders the same TrainJob without loading a kubeconfig."""
    return _kubeflow(_manifest_only, **settings)


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


def _kubeflow(cls: Any, **settings: Any) -> run.Executor:
    own = {f.name for f in dataclasses.fields(KubernetesSite)}
    site = KubernetesSite(**{k: v for k, v in settings.items() if k in own})
    fields = {k: v for k, v in settings.items() if k not in own}
    if site.trainer_api not in TRAINER_APIS:
        raise LaunchError(
            f"trainer_api={site.trainer_api!r} is not one of {', '.join(TRAINER_APIS)}: use the Kubeflow Trainer "
            "release your cluster runs (`kubectl get crd trainjobs.trainer.kubeflow.org -o yaml` shows "
            "runtimePatches from v2.2 on)"
        )
    volumes, mounts = _pvc_volumes(
        (("data", site.data_pvc, site.data_path), ("checkpoints", site.checkpoints_pvc, site.checkpoints_path))
    )
    # NCCL and the dataloader workers exchange tensors through /dev/shm; a pod's default is 64 MiB.
    volumes.insert(0, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": site.shm_size}})
    mounts.insert(0, {"name": "dshm", "mountPath": "/dev/shm"})
    env = dict(site.env_vars or {})
    if site.package_qvl:
        fields |= _workdir_with_qvl(site.workdir_pvc, volumes, mounts, env)
    elif site.workdir_pvc:
        fields["workdir_pvc"] = site.workdir_pvc
    if site.trainer_api == "v2.2+":
        fields["spec_kwargs"] = {RUNTIME_PATCHES: [], **fields.get("spec_kwargs", {})}
    return cls(
        image=site.image,
        num_nodes=site.nodes,
        gpus_per_node=site.gpus_per_node,
        namespace=site.namespace,
        runtime_ref=site.runtime,
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
    for folder in FOLDERS:
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
    """Whether `executor` runs the job on the CPU runtime (a local executor without GPUs, a CPU partition)."""
    return executor.env_vars.get(CPU_DEVICE_ENV) == "cpu"


def world_shape(executor: run.Executor) -> tuple[int, int]:
    """(nodes, processes per node) the executor will start."""
    if isinstance(executor, run.SlurmExecutor):
        return executor.nodes, executor.nproc_per_node()
    return executor.nnodes(), executor.nproc_per_node()


def rendezvous_rule(executor: run.Executor) -> str:
    """How the executor's ranks find each other, in the words of qvl.foundation.rendezvous (for `--dryrun`)."""
    nodes, per_node = world_shape(executor)
    if isinstance(executor, run.SlurmExecutor):
        if executor.launcher is None:
            return f"slurm ({nodes} node(s) x 1 process): {RULES['slurm']}"
        return (
            f"env ({nodes} node(s) x {per_node} processes): torchrun on each node meets the others at "
            f"$head_node_ip:$MASTER_PORT (c10d; MASTER_PORT as in the slurm rule: {SLURM_PORT_BASE} + SLURM_JOB_ID "
            f"% {SLURM_PORT_SPAN}), then {RULES['env']}"
        )
    if executor.launcher is None:
        return f"single: {RULES['single']}"
    return f"env ({nodes} node(s) x {per_node} processes): {RULES['env']}"


def per_node_setting(executor: run.Executor) -> str:
    """The site-file setting that gave the processes per node, for messages (what the user set, not a synonym)."""
    if isinstance(executor, run.SlurmExecutor):
        if executor.torchrun_nproc_per_node:
            return "torchrun_nproc_per_node"
        return "processes_per_node" if is_cpu(executor) else "gpus_per_node"
    if isinstance(executor, run.LocalExecutor):
        return "cpu_processes" if is_cpu(executor) else "gpus"
    return "gpus_per_node"
