"""Checks before submission: parallel layout against the world size, required executor settings, mounts.

Each check raises `LaunchError` naming the offending value and the change that fixes it, so a bad
launch fails on the laptop in a second instead of in the queue an hour later.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qvl.foundation.errors import LaunchError
from qvl.foundation.families import FAMILIES
from qvl.foundation.layout import ModelFacts, ParallelLayout, check_model_layout, world_fixes
from qvl.launchers.site import missing_required
from qvl.recipes.architectures import ARCHITECTURES

LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")
Layout = ParallelLayout  # the launch's layout is the one layout record


def layout_from_settings(registered: dict[str, Any], overrides: dict[str, Any]) -> ParallelLayout:
    """The recipe's registered layout with the user's overrides of the same names on top."""
    merged = {k: v for k, v in (registered | overrides).items() if k in LAYOUT_KEYS and v is not None}
    for key, value in merged.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LaunchError(f"{key}={value!r} must be a positive integer")
    return ParallelLayout(**merged)


def check_world_size(
    layout: ParallelLayout,
    *,
    nodes: int,
    per_node: int,
    per_node_name: str = "gpus_per_node",
    gpu: bool = True,
    model: ModelFacts | None = None,
) -> None:
    """Fail when the model cannot be split as asked, or the world (nodes x per_node ranks) cannot hold the layout.

    The model's own constraints (heads, KV heads, layers, experts) come first: no node count fixes those."""
    world = nodes * per_node
    if model is not None:
        check_model_layout(model, layout, world_size=world)
    shape = f"nodes={nodes} x {per_node_name}={per_node}"
    needed, what = layout.ranks, layout.describe()
    if world < needed or world % needed:
        problem = "is smaller than the recipe's layout" if world < needed else "is not divisible by"
        fixes = [_fix(needed, nodes, per_node, per_node_name)]
        if model is not None:  # layouts that fit this world, as another way out
            fixes += world_fixes(model, layout, world)
        ranks = " ranks" if world < needed else ""
        raise LaunchError(f"world size {world} ({shape}) {problem} {what} = {needed}{ranks}; {' or '.join(fixes)}")
    if gpu and layout.tensor_parallel > per_node:
        raise LaunchError(
            f"tensor_parallel={layout.tensor_parallel} is larger than {per_node_name}={per_node}: "
            "tensor parallelism all-reduces in every layer and must stay inside one node's NVLink "
            f"domain; use tensor_parallel<={per_node} and spread across nodes with pipeline_parallel"
        )


def check_recipe_gpus(
    recipe: str,
    sized_for: int | None,
    *,
    nodes: int,
    per_node: int,
    layout_overridden: bool,
    per_node_name: str = "gpus_per_node",
) -> None:
    """Fail when a GPU world is smaller than the recipe was sized for (its registered `gpus`), unless the
    user changed the layout (then memory per GPU is theirs to judge)."""
    world = nodes * per_node
    if not sized_for or layout_overridden or world >= sized_for:
        return
    fix = -(-sized_for // per_node)
    raise LaunchError(
        f"recipe {recipe} is sized for {sized_for} GPUs but the executor has {world} "
        f"(nodes={nodes} x {per_node_name}={per_node}); use nodes={fix}, or override the layout "
        "(tensor_parallel=..., pipeline_parallel=...) if a smaller run fits in memory"
    )


def _fix(needed: int, nodes: int, per_node: int, per_node_name: str) -> str:
    """Node counts near `nodes` whose world size fits `needed`."""
    fits = [n for n in range(1, max(2 * nodes, needed) + 2) if n * per_node >= needed and (n * per_node) % needed == 0]
    below = [n for n in fits if n < nodes][-1:]
    above = [n for n in fits if n > nodes][:1]
    if below or above:
        return "use " + " or ".join(f"nodes={n}" for n in below + above)
    return f"use a {per_node_name} that is a multiple of {needed}, or a smaller layout"


def check_required(kind: str, factory: Callable[..., Any], settings: dict[str, Any]) -> None:
    """Fail when a setting the `kind` executor cannot do without is absent."""
    missing = missing_required(factory, settings)
    if missing:
        flags = " ".join(f"run.executor.{name}=..." for name in missing)
        raise LaunchError(
            f"the {kind} executor needs {', '.join(missing)}: set them in the site file "
            f"(--executor-config site.yaml, section {kind}:) or pass {flags}"
        )


def check_accepted(kind: str, accepted: set[str], settings: dict[str, Any]) -> None:
    """Fail on a setting the `kind` executor does not have (a typo would otherwise be ignored)."""
    unknown = sorted(set(settings) - accepted)
    if unknown:
        raise LaunchError(
            f"the {kind} executor has no setting {', '.join(unknown)}; it takes: {', '.join(sorted(accepted))}"
        )


def check_mounts(mounts: Sequence[str]) -> None:
    """Fail on a `src:dst` mount whose source is not readable here (dry runs on the submitting host)."""
    for mount in mounts:
        src = mount.split(":", 1)[0]
        if not src.startswith("/"):
            raise LaunchError(f"mount {mount!r}: the source must be an absolute path (src:dst)")
        if not os.access(src, os.R_OK):
            raise LaunchError(
                f"mount {mount!r}: {src} does not exist or is not readable here; fix the path in "
                "mounts=[...] (or the site file), or dry-run on a host that sees the cluster's filesystem"
            )


def check_ssh_job_dir(settings: dict[str, Any]) -> None:
    """Fail when a Slurm launch over SSH has no experiments folder on the cluster."""
    if settings.get("host") and not settings.get("job_dir"):
        raise LaunchError(
            f"slurm over SSH (host={settings['host']}) needs job_dir: the experiments folder on the "
            "cluster's shared filesystem, e.g. run.executor.job_dir=/lustre/$USER/qvl"
        )


def recipe_model_facts(info: Any, hf_path: Any = None) -> ModelFacts | None:
    """What a recipe's layout must divide, without building it: a local checkpoint's config.json where
    `hf_path` is one, else the published architecture of the recipe's family and size (None for a recipe of
    no known family, whose layout is then checked against the world size only)."""
    family = FAMILIES.get(info.family)
    if family is None or (info.family, info.size) not in ARCHITECTURES:
        return None
    config = Path(str(hf_path)) / "config.json" if hf_path else None
    if config is not None and config.is_file():
        raw = json.loads(config.read_text())
        text, vision = raw.get("text_config", raw), raw.get("vision_config", {})
        name = str(hf_path)
    else:
        arch = ARCHITECTURES[info.family, info.size]
        text, vision, name = arch.text, arch.vision, f"{family.title} {info.size.upper()}"
    heads = text["num_attention_heads"]
    return ModelFacts(
        attention_heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        layers=text["num_hidden_layers"],
        experts=text.get("num_experts") or None,
        vision_heads=vision.get("num_heads") if family.megatron_vision_tower else None,
        name=name,
    )


def experiments_home(executor: Any, experiments_dir: str | None, flag: str = "--experiments-dir") -> str | None:
    """The experiments folder of a launch, agreed between `--experiments-dir` and a local Slurm tunnel's `job_dir`.

    NeMo-Run writes the sbatch script under the experiment's folder (`--experiments-dir`, default $NEMORUN_HOME)
    but submits it from `<tunnel job_dir>/<title>/<id>/`; only an SSH tunnel copies one to the other. So on a
    local tunnel `job_dir` is the experiments folder too, and the tunnel is pointed at the same place."""
    import nemo_run as run
    from nemo_run.config import get_nemorun_home

    if not (isinstance(executor, run.SlurmExecutor) and isinstance(executor.tunnel, run.LocalTunnel)):
        return experiments_dir
    job_dir = executor.tunnel.job_dir
    if job_dir and experiments_dir and os.path.abspath(job_dir) != os.path.abspath(experiments_dir):
        raise LaunchError(
            f"job_dir={job_dir} and {flag}={experiments_dir} disagree: submitting on this machine both name the "
            "experiments folder; set one of them (or the same folder in both)"
        )
    home = os.path.abspath(experiments_dir or job_dir or get_nemorun_home())
    executor.tunnel.job_dir = os.path.join(home, "experiments")
    return home


def check_container_runtime(executor: Any) -> None:
    """Fail when a Slurm job asks for a container on a cluster whose srun (here) has no pyxis: the job would be
    refused in the queue (`srun: unrecognized option '--container-image'`) after sbatch accepted it."""
    import nemo_run as run

    if not (isinstance(executor, run.SlurmExecutor) and isinstance(executor.tunnel, run.LocalTunnel)):
        return
    if not executor.container_image or not shutil.which("srun"):
        return
    usage = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30)
    if "--container-image" not in usage.stdout + usage.stderr:
        raise LaunchError(
            f"container_image={executor.container_image} needs pyxis (`srun --container-image`), which this "
            "cluster's srun does not have: remove container_image to run the job in this Python environment "
            "(on a filesystem the compute nodes share), or ask the admins for pyxis/enroot"
        )


def check_slurm_request(executor: Any) -> None:
    """Fail before sbatch on what this cluster would refuse or never start: a partition it does not have, more
    nodes than the partition holds, an account the user has no association with, more processes per node than a
    CPU partition's nodes have cores. Only where sbatch runs here (a local tunnel) and Slurm's clients answer."""
    import nemo_run as run

    from qvl.launchers.executors import is_cpu, per_node_setting, world_shape

    if not (isinstance(executor, run.SlurmExecutor) and isinstance(executor.tunnel, run.LocalTunnel)):
        return
    if not shutil.which("scontrol"):
        return
    partitions = _slurm_partitions()
    if not partitions:
        return  # no controller answered: sbatch will say so
    name = executor.partition or next((n for n, p in partitions.items() if p.get("Default") == "YES"), None)
    if name is None:
        return
    if name not in partitions:
        raise LaunchError(
            f"partition={name} does not exist on this cluster; use one of {', '.join(sorted(partitions))} "
            "(`sinfo -s` lists them) in the site file or run.executor.partition=..."
        )
    nodes, per_node = world_shape(executor)
    total = int(partitions[name].get("TotalNodes", 0) or 0)
    if total and nodes > total:
        raise LaunchError(
            f"nodes={nodes} is more than partition {name} has ({total}); use nodes<={total} or a larger partition"
        )
    if is_cpu(executor):
        cores = _slurm_out(["sinfo", "-h", "-N", "-p", name, "-o", "%c"]).split()
        fewest = min(map(int, cores)) if cores else 0
        if fewest and per_node > fewest:
            raise LaunchError(
                f"{per_node_setting(executor)}={per_node} is more than the {fewest} CPUs of a node in partition "
                f"{name}; use {per_node_setting(executor)}<={fewest}"
            )
    _check_slurm_account(executor.account)


def _check_slurm_account(account: str | None) -> None:
    if not account or not shutil.which("sacctmgr"):
        return
    user = getpass.getuser()
    shown = _slurm_out(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", "format=Account"])
    accounts = sorted(set(shown.split()))
    if accounts and account not in accounts:
        raise LaunchError(
            f"account={account} is not a Slurm account of user {user}; use one of {', '.join(accounts)} "
            f"(`sacctmgr show assoc user={user}`) in the site file or run.executor.account=..."
        )


def _slurm_partitions() -> dict[str, dict[str, str]]:
    """Every partition's settings as `scontrol -o show partition` prints them ({} when Slurm does not answer)."""
    partitions = {}
    for line in _slurm_out(["scontrol", "-o", "show", "partition"]).splitlines():
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "PartitionName" in fields:
            partitions[fields["PartitionName"]] = fields
    return partitions


def _slurm_out(argv: list[str]) -> str:
    """stdout of a Slurm client command, "" where it fails (the check it serves is then skipped)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def check_nemo_run_paths(executor: Any, texts: Sequence[str] = ()) -> None:
    """Fail when a container-less Slurm job's script would hold `/nemo_run`: NeMo-Run 0.11.1 replaces every such
    substring by the job folder (nemo_run/core/execution/slurm.py ~1106, meant for the container's mount), which
    rewrites a path like /scratch/nemo_run/... and the job fails in seconds without a word from qvl."""
    import nemo_run as run

    if not isinstance(executor, run.SlurmExecutor) or executor.container_image:
        return
    candidates = [("the experiments folder (NEMORUN_HOME, --experiments-dir or job_dir)", executor.tunnel.job_dir)]
    candidates += [(f"env_vars {key}", value) for key, value in executor.env_vars.items()]
    candidates += [("the argument", text) for text in texts]
    for what, text in candidates:
        if "/nemo_run" in str(text):
            raise LaunchError(
                f"{what} {text} contains `/nemo_run`, which NeMo-Run replaces by the job folder everywhere in the "
                "sbatch script of a job without a container; use a path without it (e.g. "
                f"{str(text).replace('/nemo_run', '/nemo-run')})"
            )
