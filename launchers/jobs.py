"""`qvl launch RECIPE [key=value ...] --executor local|slurm|kubernetes [--dryrun]`: a recipe run through NeMo-Run.

The submitting side (a laptop, Jupyter, a login node) resolves the recipe and its overrides, checks the
layout against the executor, and hands NeMo-Run an experiment with one task: the `qvl` command line
(`python -m qvl.launchers.cli train RECIPE key=value ...`) under torchrun. The execution side, a NeMo
container with qvl installed, builds the recipe's config from the same overrides (`--model tiny` trains the
recipe's family at a tiny size). The built-in job `demo` runs `qvl demo`, the whole pipeline on a tiny model.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qvl.foundation import patches
from qvl.foundation.errors import ConfigError, LaunchError
from qvl.foundation.layout import ModelFacts, ParallelLayout
from qvl.kernels.fix_kubeflow_v2_2 import GROUP as TRAINJOB_PATCHES  # runtimePatches for Trainer v2.2+
from qvl.launchers.preflight import (
    LAYOUT_KEYS,
    check_accepted,
    check_container_runtime,
    check_mounts,
    check_nemo_run_paths,
    check_recipe_gpus,
    check_required,
    check_slurm_request,
    check_ssh_job_dir,
    check_world_size,
    experiments_home,
    layout_from_settings,
    recipe_model_facts,
)
from qvl.launchers.site import load_site_config, missing_required, to_plain
from qvl.recipes.overrides import Overrides, parse_overrides
from qvl.recipes.registry import get_recipe

logger = logging.getLogger(__name__)

CLI_MODULE = "qvl.launchers.cli"  # what `python -m` runs on the execution side: the `qvl` command line
DEMO_JOB = "demo"  # built-in tiny job: `qvl demo --steps N --output DIR`
DEMO_PARAMS = ("steps", "output")
EXECUTORS = ("local", "slurm", "kubernetes")
TASKS = ("train", "reference")  # the `qvl` commands a recipe job runs


@dataclass(kw_only=True, slots=True)
class Job:
    """What runs: the recipe, its sorted overrides, the qvl arguments and the parallel layout."""

    recipe: str
    overrides: Overrides
    argv: list[str]
    layout: ParallelLayout
    recipe_fn: Any = None
    registered_gpus: int | None = None  # the GPU count the recipe's layout was planned for
    model: ModelFacts | None = None  # what the layout must divide (None for the demo job)
    train_flags: list[str] = field(default_factory=list)

    @property
    def tiny(self) -> bool:
        """`--model tiny`: a tiny random model on one process, whatever the recipe was sized for."""
        return "--model" in self.train_flags


def resolve_job(recipe: str, pairs: Sequence[str], train_flags: Sequence[str] = (), task: str = "train") -> Job:
    """Look `recipe` up and sort its overrides; the argv is what `qvl` runs on the execution side.

    `train_flags` are `qvl train` options passed through (`--model tiny`, `--run-dir DIR`); `task` is the `qvl`
    command the job runs with them: `train`, or `reference` (a preference recipe's reference pass, at the layout and on
    the GPUs its training will use)."""
    if task not in TASKS:
        raise LaunchError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if recipe == DEMO_JOB:
        overrides = parse_overrides(pairs, options=DEMO_PARAMS, executor=True)
        if overrides.config:
            raise LaunchError(
                f"the {DEMO_JOB} job takes only {', '.join(DEMO_PARAMS)}; got {', '.join(overrides.config)}"
            )
        argv = [DEMO_JOB] + [arg for key, value in overrides.options.items() for arg in (f"--{key}", str(value))]
        return Job(recipe=recipe, overrides=overrides, argv=argv, layout=ParallelLayout())
    try:
        info = get_recipe(recipe)
    except ConfigError as err:
        raise LaunchError(f"{err} (or `{DEMO_JOB}`, the built-in tiny job)") from err
    overrides = parse_overrides(pairs, executor=True)
    tiny = "--model" in train_flags  # `qvl train --model tiny` runs one process: no parallelism unless asked for
    missing = missing_required(info.fn, overrides.options)
    if missing:
        raise LaunchError(f"recipe {recipe} needs {', '.join(missing)}; pass " + " ".join(f"{m}=..." for m in missing))
    return Job(
        recipe=recipe,
        overrides=overrides,
        argv=[task, recipe, *overrides.texts, *train_flags],
        layout=layout_from_settings({} if tiny else info.layout, overrides.options),
        recipe_fn=info.fn,
        registered_gpus=info.gpus,
        model=None if tiny else recipe_model_facts(info, overrides.options.get("hf_path")),
        train_flags=list(train_flags),
    )


def executor_settings(
    kind: str, *, site_file: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The executor factory's keywords: the site file's `kind:` section, then command-line overrides."""
    if kind not in EXECUTORS:
        raise LaunchError(f"--executor {kind!r} is not one of {', '.join(EXECUTORS)}")
    site = load_site_config(site_file, kind) if site_file else {}
    return site | dict(overrides or {})


def build_executor(kind: str, settings: dict[str, Any], *, dryrun: bool = False):
    """The NeMo-Run executor for `kind` from checked settings; a dry run needs no cluster credentials."""
    from qvl.launchers import executors

    factory = executors.FACTORIES[kind]
    check_required(kind, factory, settings)
    accepted = set(executors.factory_settings(kind))
    check_accepted(kind, accepted, settings)
    if kind == "slurm":
        check_ssh_job_dir(settings)
    if kind != "kubernetes":
        return factory(**settings)
    if dryrun:
        return executors.kubernetes_manifest_only(**settings)
    from kubernetes.config import ConfigException

    try:  # the Kubeflow executor loads the kubeconfig when built
        return factory(**settings)
    except ConfigException as err:
        raise LaunchError(
            "the kubernetes executor needs a kubeconfig ($KUBECONFIG or ~/.kube/config) or an in-cluster "
            f"service account to submit ({err}); `--dryrun` prints the TrainJob without one"
        ) from err


# A Slurm job runs in `<job folder>/code` (NeMo-Run's `srun --chdir`, in a container `/nemo_run/code`): a recipe
# run without --run-dir goes beside it, to `<job folder>/run`, never into the shipped code.
SLURM_RUN_DIR = "../run"


def place_run_dir(job: Job, executor) -> None:
    """Give a recipe job on Slurm without `--run-dir` the job folder's `run/` (SLURM_RUN_DIR)."""
    import nemo_run as run

    if job.recipe_fn is None or "--run-dir" in job.train_flags or not isinstance(executor, run.SlurmExecutor):
        return
    job.train_flags += ["--run-dir", SLURM_RUN_DIR]
    job.argv += ["--run-dir", SLURM_RUN_DIR]


def validate(job: Job, executor) -> None:
    """Every check that needs no cluster: layout vs world size, mounts on a local tunnel."""
    import nemo_run as run

    from qvl.launchers.executors import is_cpu, per_node_setting, world_shape

    nodes, per_node = world_shape(executor)
    cpu = is_cpu(executor)
    per_node_name = per_node_setting(executor)
    check_world_size(
        job.layout, nodes=nodes, per_node=per_node, gpu=not cpu, per_node_name=per_node_name, model=job.model
    )
    if not cpu and not job.tiny:  # a tiny model drops the recipe's layout, and with it the GPU count it was sized for
        overridden = any(key in job.overrides.options for key in LAYOUT_KEYS)
        check_recipe_gpus(
            job.recipe,
            job.registered_gpus,
            nodes=nodes,
            per_node=per_node,
            per_node_name=per_node_name,
            layout_overridden=overridden,
        )
    if isinstance(executor, run.SlurmExecutor) and isinstance(executor.tunnel, run.LocalTunnel):
        check_mounts(executor.container_mounts)


def task_argv(job: Job, executor) -> list[str]:
    """The qvl arguments the execution side runs (`--device cpu` on the CPU runtime)."""
    from qvl.launchers.executors import is_cpu

    return job.argv + (["--device", "cpu"] if is_cpu(executor) else [])


def task_for(job: Job, executor):
    """The NeMo-Run task: the qvl command line, under torchrun where the executor asks for it."""
    import nemo_run as run

    argv = task_argv(job, executor)
    if isinstance(executor, run.LocalExecutor):
        # This interpreter, so the run uses the same environment (and qvl) as the submitting process.
        return run.Script(path=CLI_MODULE, m=True, entrypoint=sys.executable, args=argv)
    if isinstance(executor, run.SlurmExecutor):
        # One process per node needs no torchrun: without a container it is this interpreter (the environment on a
        # shared filesystem), in one the image's python; NeMo-Run's Torchrun launcher replaces `python` itself.
        bare = executor.launcher is None and executor.container_image is None
        return run.Script(path=CLI_MODULE, m=True, entrypoint=sys.executable if bare else "python", args=argv)
    # Kubeflow: torchrun reads its topology from the TrainJob's PET_* variables
    return run.Script(path="-m", entrypoint="torchrun", args=[CLI_MODULE, *argv])


def new_experiment(
    executor, *, name: str, experiments_dir: str | None = None, exp_id: str | None = None, quiet: bool = False
):
    """A NeMo-Run experiment (its folder holds the name, logs and status of every task)."""
    import nemo_run as run
    from nemo_run.core.execution.launcher import Torchrun

    exp_id = exp_id or f"{name}_{time.time_ns()}"
    if isinstance(executor.launcher, Torchrun) and executor.launcher.rdzv_id is None:
        # Fixed per experiment, so the dry run shows the script that is submitted, byte for byte.
        executor.launcher.rdzv_id = zlib.crc32(exp_id.encode()) % 10_000 + 1
    return run.Experiment(
        name, executor=executor, id=exp_id, base_dir=experiments_dir, log_level="WARN", clean_mode=quiet
    )


def render_dryrun(exp) -> str:
    """The exact scheduler request NeMo-Run would submit: sbatch script, TrainJob manifest or local command."""
    from nemo_run.core.execution.slurm import SlurmBatchRequest

    exp.dryrun(log=False, delete_exp_dir=False)
    try:
        request = exp.jobs[0]._dryrun_info.request
        if isinstance(request, SlurmBatchRequest):
            return request.materialize()
        if hasattr(request, "role_params"):  # torchx PopenRequest: one process per replica on this machine
            return _local_command(exp.jobs[0].executor, request)
        executor = request.executor
        job_name = executor._trainjob_name(request.name)  # the name launch() will use
        manifest = yaml.safe_dump(executor.get_job_body(job_name, request.cmd), sort_keys=False)
        script = Path(executor.job_dir) / "launch.sh"  # with a workdir PVC the pods run this script from it
        if executor.workdir_pvc and script.is_file():
            manifest += f"---\n# {executor.code_dir}/launch.sh\n" + script.read_text()
        return manifest
    finally:
        shutil.rmtree(exp._exp_dir, ignore_errors=True)


def _local_command(executor, request) -> str:
    lines = []
    for replicas in request.role_params.values():
        for replica in replicas:
            env = " ".join(f"{k}={_shell_value(k, v)}" for k, v in sorted(executor.env_vars.items()))
            lines.append((f"env {env} " if env else "") + shlex.join(replica.args))
    return "\n".join(lines) + "\n"


def _shell_value(key: str, value: str) -> str:
    inherited = os.environ.get(key)
    if inherited and value.endswith(os.pathsep + inherited):  # PATH-like: prefix + what this shell has
        return shlex.quote(value.removesuffix(os.pathsep + inherited)) + f"{os.pathsep}${key}"
    return shlex.quote(value)


def resolved_config(job: Job, executor, *, build: bool = False) -> dict[str, Any]:
    """What the execution side will run: its command, rendezvous rule, layout and recipe arguments; with `build`,
    the config it will build too (`qvl train`'s own preparation, run here with the job's flags and the executor's
    device; where it cannot be built here, why). Building imports Megatron-Bridge: ~15 s of CPU, three times the
    rest of a dry run, so a plain `--dryrun` leaves it to `--resolve` (and to the submit, which always builds it)."""
    from qvl.launchers.executors import rendezvous_rule

    summary: dict[str, Any] = {
        "recipe": job.recipe,
        "command": "qvl " + shlex.join(task_argv(job, executor)),
        "rendezvous": rendezvous_rule(executor),
        "layout": to_plain(job.layout),
        "arguments": job.overrides.options,
    }
    if job.recipe_fn is None:
        return summary
    if job.overrides.config:
        summary["config_overrides"] = job.overrides.config
    if not build:
        return summary | {"config": "not built by a plain --dryrun; add --resolve to build and print it here"}
    try:
        config = build_job_config(job, executor)
    except OSError as err:  # e.g. a stand-in recipe that reads a file only the cluster has
        return summary | {"config": f"not built here ({type(err).__name__}: {err})"}
    return summary | {"config": to_plain(config, depth=2)}


def build_job_config(job: Job, executor) -> Any:
    """Build the job's ConfigContainer here exactly as `qvl train` will there, which checks every dotted key."""
    from qvl.launchers.executors import is_cpu
    from qvl.training.loop import TrainRequest, prepare_config

    flags = dict(zip(job.train_flags[::2], job.train_flags[1::2], strict=False))
    run_dir = Path(flags.get("--run-dir", "runs/train"))
    request = TrainRequest(
        recipe=job.recipe,
        overrides=job.overrides.options | job.overrides.config,
        run_dir=run_dir,
        model=flags.get("--model"),
    )
    with tempfile.TemporaryDirectory(prefix="qvl-dryrun-") as tiny_dir:
        # A tiny model's checkpoint is written where the job runs; here it goes to a scratch folder and the
        # config is given the job's path, so the printed config is the job's.
        _, config = prepare_config(request, cpu=is_cpu(executor), tiny_dir=Path(tiny_dir))
    if request.model == "tiny" and "hf_path" not in job.overrides.options:
        config.dataset.hf_path = str(run_dir / "tiny-hf")
    return config


def launch(
    recipe: str,
    pairs: Sequence[str],
    *,
    train_flags: Sequence[str] = (),
    kind: str = "local",
    site_file: str | None = None,
    dryrun: bool = False,
    resolve: bool = False,
    name: str | None = None,
    experiments_dir: str | None = None,
    exp_id: str | None = None,
    wait: bool | None = None,
    task: str = "train",
) -> dict[str, Any]:
    """Resolve, validate and run (or dry-run) `recipe`; returns what happened for the CLI to print.

    A dry run prints the request and what the job runs; with `resolve` also the config it builds.
    With `wait` (the default on this machine) a job that does not succeed raises LaunchError naming its state and
    log; any refusal by the scheduler (sbatch, the Kubernetes API) does too."""
    job = resolve_job(recipe, pairs, train_flags, task=task)
    settings = executor_settings(kind, site_file=site_file, overrides=job.overrides.executor)
    executor = build_executor(kind, settings, dryrun=dryrun)
    experiments_dir = experiments_home(executor, experiments_dir)
    place_run_dir(job, executor)
    validate(job, executor)
    check_nemo_run_paths(executor, task_argv(job, executor))
    if not dryrun:
        check_container_runtime(executor)
        check_slurm_request(executor)
        if job.recipe_fn is not None:
            build_job_config(job, executor)  # every key checked here, before the job waits in a queue
    name = name or f"qvl-{recipe}".replace("_", "-")
    exp = new_experiment(executor, name=name, experiments_dir=experiments_dir, exp_id=exp_id, quiet=dryrun)
    result = {"experiment": exp._id, "title": name, "folder": exp._exp_dir, "executor": kind}
    wait = kind == "local" if wait is None else wait
    with exp, patches.applied(TRAINJOB_PATCHES):  # a Kubeflow Trainer v2.2+ TrainJob gets runtimePatches
        exp.add(task_for(job, executor), name=job.recipe)
        if dryrun:
            return result | {"request": render_dryrun(exp), "config": resolved_config(job, executor, build=resolve)}
        logger.info("submitting experiment %s to %s: qvl %s", exp._id, kind, shlex.join(task_argv(job, executor)))
        submit(exp, wait=wait)
    result |= {"states": [str(j.state).split(".")[-1] for j in exp.jobs], "job_ids": [job_id(j) for j in exp.jobs]}
    if wait:
        check_succeeded(exp, result)
    return result


def submit(exp, *, wait: bool) -> None:
    """Run the experiment; a scheduler's refusal (sbatch's error, a failed command) becomes one LaunchError line."""
    from invoke.exceptions import UnexpectedExit

    try:
        exp.run(detach=not wait, tail_logs=False)
    except UnexpectedExit as err:
        command = err.result.command.split()[0] if err.result.command else "the scheduler"
        raise LaunchError(f"{command} refused the job: {_first_error(err.result.stderr or err.result.stdout)}") from err


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines or ["no output"]
    return errors[0]


def job_id(job) -> str:
    """The scheduler's id of a NeMo-Run job (its Slurm job id, TrainJob name or local process id)."""
    return job.handle.rstrip("/").rsplit("/", 1)[-1] if job.handle else ""


def check_succeeded(exp, result: dict[str, Any]) -> None:
    """Fail (one line: state, id, log) when a job that was waited for did not succeed."""
    for job, state, ident in zip(exp.jobs, result["states"], result["job_ids"], strict=True):
        if state != "SUCCEEDED":
            folder = Path(job.executor.job_dir)
            logs = sorted(folder.glob(f"log*{ident}*")) or [folder]
            failed = failed_tasks(sorted(folder.glob(f"*{ident}*"))) if ident else ""
            raise LaunchError(
                f"{result['executor']} job {ident or job.id} ({job.id}) ended {state}{failed}; its log: {logs[-1]} "
                f"(or NEMORUN_HOME={Path(result['folder']).parents[2]} nemo experiment logs {result['experiment']} 0)"
            )


# srun's own words for a task that ended badly (Slurm 22.05): "srun: error: node2: task 1: Exited with exit code 2"
_SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")


def failed_tasks(paths: Sequence[Path]) -> str:
    """ ", first on NODE (task N: what srun said)" for the task srun saw fail first in a job's logs ("" if none):
    with --kill-on-bad-exit the other ranks are then killed, so the first non-kill failure names the culprit."""
    errors = []
    for path in paths:
        try:
            errors += _SRUN_TASK_ERROR.findall(path.read_text(errors="replace"))
        except OSError:
            continue
    culprits = [e for e in errors if not e[2].startswith(("Killed", "Terminated"))] or errors
    if not culprits:
        return ""
    node, task, what = culprits[0]
    return f", first on {node} (task {task}: {what.strip().rstrip('.')})"
