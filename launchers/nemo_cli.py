"""`nemo qvl ...`: qvl's entrypoints in NeMo-Run's CLI (entry-point group `nemo_run.cli`, name `qvl`).

NeMo-Run imports this module when `nemo qvl` runs; each `@run.cli.entrypoint(namespace="qvl")`
function becomes a subcommand:

    nemo qvl finetune --factory RECIPE recipe.tensor_parallel=4 run.executor=slurm run.executor.nodes=4
    nemo qvl pretrain --factory demo recipe.steps=2 run.executor=local --dryrun

`--factory` choices are the registered recipes (sft/peft ones under `finetune`, pretrain ones under
`pretrain`) plus `demo`, the built-in tiny job. `recipe.<keyword>=...` overrides a recipe option
(checked against qvl.recipes.options like every qvl override), `overrides` (a list of key=value strings, the
same grammar as `qvl train`) is appended as is, and
`run.executor=local|slurm|kubernetes` picks an executor factory whose defaults come from the site file
named by $QVL_EXECUTOR_CONFIG. The entrypoint runs where the executor puts it and executes
`qvl train RECIPE key=value ...` (or `qvl demo`) there, the same command `qvl launch` submits.
"""

import dataclasses
import functools
import inspect
import logging
import os
import sys
import typing
from collections.abc import Callable
from typing import Any, Optional

from qvl.foundation import patches
from qvl.foundation.errors import LaunchError, QvlError
from qvl.foundation.megatron import import_megatron_bridge
from qvl.launchers.cli import main, quiet_logging
from qvl.launchers.info import run_version
from qvl.launchers.site import load_site_config
from qvl.recipes.options import RecipeOptions, did_you_mean, option_names

# Before the recipe factories below import Megatron-Bridge: its import probes and fallback warnings would
# print dozens of lines ahead of `--help`. Same filters as `qvl`; `nemo qvl ... --verbose` shows them.
_VERBOSE = bool({"-v", "--verbose"} & set(sys.argv))
quiet_logging(verbose=_VERBOSE)
if not _VERBOSE:  # NeMo-Run logs each argument error before raising it; the error line below says it once
    logging.getLogger("nemo_run.cli.cli_parser").setLevel(logging.CRITICAL)

import fiddle as fdl  # noqa: E402
import nemo_run as run  # noqa: E402
from nemo_run.cli.cli_parser import CLIException  # noqa: E402
from nemo_run.config import get_nemorun_home  # noqa: E402

from qvl.launchers import executors  # noqa: E402
from qvl.launchers.jobs import DEMO_JOB, SLURM_RUN_DIR, TRAINJOB_PATCHES, resolve_job, validate  # noqa: E402
from qvl.launchers.preflight import check_nemo_run_paths, check_slurm_request, experiments_home  # noqa: E402
from qvl.recipes.registry import all_recipes, old_name  # noqa: E402

# `nemo` loads every `nemo_run.cli` entry point, Megatron-Bridge's own (`lm`) among them, which imports it without
# the stand-ins a machine without Transformer Engine needs: Megatron-Bridge is imported here first, with them.
import_megatron_bridge()

SITE_CONFIG_ENV = "QVL_EXECUTOR_CONFIG"


@run.cli.entrypoint(namespace="qvl", help="Print qvl and Megatron stack versions (same as `qvl version`).")
def version() -> None:
    """Print the versions `qvl version` prints."""
    run_version(None)


def demo(steps: int = 20, output: str = ".demo") -> None:
    """The built-in tiny job (`qvl demo`), as a recipe-like signature for `recipe.steps=...`; never called:
    the entrypoint turns it into the `qvl demo` command line."""


class CheckedRunContext(run.cli.RunContext):
    """NeMo-Run's run context plus qvl's checks (layout vs world size, recipe keywords) before anything runs."""

    def _execute_task(self, fn: Callable, task_args: list[str]) -> None:
        try:
            executor = getattr(self, "executor", None)
            task_args = with_default_output_dir(task_args, executor)
            check_task(self.parse_fn(fn, task_args), executor)
            if executor is not None:  # NeMo-Run's experiments live in $NEMORUN_HOME; a local tunnel must agree
                experiments_home(executor, get_nemorun_home(), flag="NEMORUN_HOME")
                check_nemo_run_paths(executor)
                if not self.dryrun:
                    check_slurm_request(executor)
        except (QvlError, CLIException) as err:
            # As `qvl` does: one line naming the value and the fix, exit status 2 (NeMo-Run would print its
            # own context dump and exit 1).
            print(f"error: {_one_line(err)}", file=sys.stderr)
            raise SystemExit(2) from None
        with patches.applied(TRAINJOB_PATCHES):  # a Kubeflow Trainer v2.2+ TrainJob gets runtimePatches
            super()._execute_task(fn, task_args)


def with_default_output_dir(task_args: list[str], executor: Optional[run.Executor]) -> list[str]:
    """On Slurm, `output_dir` defaults to the job folder's `run/` (beside the job's code folder, as `qvl launch`)."""
    given = any(arg.split("=", 1)[0].lstrip("-").replace("-", "_") == "output_dir" for arg in task_args)
    if given or not isinstance(executor, run.SlurmExecutor):
        return task_args
    return [*task_args, f"output_dir={SLURM_RUN_DIR}"]


def _one_line(err: Exception) -> str:
    """A NeMo-Run argument error as qvl words it: the unknown `recipe.<key>` with the closest recipe options."""
    if not isinstance(err, CLIException):
        return str(err)
    key = str(err.context.get("key", err.arg))
    if key.startswith("recipe.") and "No parameter named" in str(err):
        name = key.removeprefix("recipe.")
        return f"{key}: {name!r} is not a recipe option{did_you_mean(name, option_names())}"
    return err.user_friendly_message()


def check_task(task: run.Partial, executor: Optional[run.Executor]) -> None:
    """Resolve the task's recipe and overrides and check them against the executor (LaunchError if wrong)."""
    recipe = fdl.build(task.recipe)
    job = resolve_job(
        _recipe_name(recipe.func), _pairs(recipe, task.overrides), _train_flags(task.model, task.output_dir)
    )
    if executor is not None:
        validate(job, executor)


@run.cli.entrypoint(
    namespace="qvl",
    run_ctx_cls=CheckedRunContext,
    help="Pretrain a recipe (`--factory RECIPE`) on the chosen executor.",
)
def pretrain(
    recipe: Any, overrides: Optional[list[str]] = None, model: Optional[str] = None, output_dir: Optional[str] = None
) -> None:
    """Run `qvl train` for the configured recipe (a Partial of the recipe function) where this executes;
    `model=tiny` and `output_dir=DIR` are `qvl train`'s `--model` and `--run-dir` (NeMo-Run reserves `run*` names)."""
    _run_recipe(recipe, overrides, _train_flags(model, output_dir))


@run.cli.entrypoint(
    namespace="qvl",
    run_ctx_cls=CheckedRunContext,
    help="Fine-tune (SFT or PEFT) a recipe (`--factory RECIPE`) on the chosen executor.",
)
def finetune(
    recipe: Any, overrides: Optional[list[str]] = None, model: Optional[str] = None, output_dir: Optional[str] = None
) -> None:
    """Run `qvl train` for the configured recipe (a Partial of the recipe function) where this executes;
    `model=tiny` and `output_dir=DIR` are `qvl train`'s `--model` and `--run-dir` (NeMo-Run reserves `run*` names)."""
    _run_recipe(recipe, overrides, _train_flags(model, output_dir))


def recipe_command(
    recipe: functools.partial, overrides: Optional[list[str]] = None, train_flags: list[str] = ()
) -> list[str]:
    """The qvl arguments for a built recipe Partial: `train NAME key=value ...` or `demo --steps N ...`."""
    argv = resolve_job(_recipe_name(recipe.func), _pairs(recipe, overrides), train_flags).argv
    # The local executor marks CPU-only runs; the job then uses qvl's CPU runtime.
    return argv + (["--device", "cpu"] if os.environ.get(executors.CPU_DEVICE_ENV) == "cpu" else [])


def _pairs(recipe: functools.partial, overrides: Optional[list[str]]) -> list[str]:
    return [f"{key}={value}" for key, value in recipe.keywords.items()] + list(overrides or [])


def _train_flags(model: Optional[str], run_dir: Optional[str]) -> list[str]:
    if model not in (None, "tiny"):
        raise LaunchError(
            f"model={model!r}: the only model choice is tiny (a tiny random model of the recipe's family)"
        )
    return (["--model", model] if model else []) + (["--run-dir", run_dir] if run_dir else [])


def _run_recipe(recipe: functools.partial, overrides: Optional[list[str]], train_flags: list[str]) -> None:
    argv = recipe_command(recipe, overrides, train_flags)
    code = main(argv)
    if code:
        raise RuntimeError(f"`qvl {' '.join(argv)}` exited with status {code}")


def _recipe_name(fn: Any) -> str:
    if fn is demo:
        return DEMO_JOB
    if fn in _TYPED_RECIPES:
        return _TYPED_RECIPES[fn]
    for info in all_recipes():
        if info.fn is fn:
            return info.name
    raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is not a registered recipe (`qvl recipes` lists them)")


def _register_recipe_factories() -> None:
    """One `--factory` per registered recipe, under `finetune` (sft, peft) or `pretrain`."""
    for target in (pretrain, finetune):
        run.cli.factory(_factory(target, demo), target=target, name=DEMO_JOB)
    for info in all_recipes():
        target = pretrain if info.stage == "pretrain" else finetune
        typed = _typed_recipe(info)
        for name in filter(None, (info.name, old_name(info.name))):  # the old spelling keeps working
            run.cli.factory(_factory(target, typed), target=target, name=name)


_TYPED_RECIPES: dict[Callable, str] = {}


def _typed_recipe(info: Any) -> Callable:
    """The recipe with every recipe option declared with its type, for `recipe.<option>=value`.

    NeMo-Run parses `recipe.x=v` by the type of the recipe's parameter `x`, and a recipe's `**overrides: Any` has
    none ("Unsupported type: Any"). The wrapper is a module attribute named after the recipe, so NeMo-Run can
    serialize it; options left at None are not passed, so the recipe's own defaults apply."""
    params = inspect.signature(info.fn).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return info.fn  # an explicit signature is already typed
    hints = typing.get_type_hints(RecipeOptions)

    def recipe(**options: Any) -> Any:
        return info.fn(**{k: v for k, v in options.items() if v is not None})

    recipe.__signature__ = inspect.Signature(
        [
            # tuple options (freeze, recompute_modules) are given as comma-separated text, as on `qvl train`
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[_cli_type(hints[f.name])]
            )
            for f in dataclasses.fields(RecipeOptions)
        ]
    )
    recipe.__name__ = recipe.__qualname__ = info.name
    recipe.__module__ = __name__
    recipe.__doc__ = info.fn.__doc__
    globals()[info.name] = recipe
    _TYPED_RECIPES[recipe] = info.name
    return recipe


def _cli_type(hint: Any) -> Any:
    members = [m for m in typing.get_args(hint) if m is not type(None)] or [hint]
    kind = members[0]
    return str if typing.get_origin(kind) is tuple else kind


def _factory(target: Any, fn: Any) -> Any:
    def make() -> run.Partial:
        return run.Partial(target, recipe=run.Partial(fn))

    make.__name__ = f"{getattr(fn, '__name__', 'recipe')}_{target.__name__}"
    return make


def _site_settings(kind: str) -> dict[str, Any]:
    path = os.environ.get(SITE_CONFIG_ENV)
    return load_site_config(path, kind) if path else {}


@run.cli.factory(target=run.Executor, name="local")
def local_executor() -> run.Config:
    """This machine (torchrun over its GPUs, or the CPU runtime); `run.executor.gpus=0` forces CPU."""
    return run.Config(executors.local, **_site_settings("local"))


@run.cli.factory(target=run.Executor, name="slurm")
def slurm_executor() -> run.Config:
    """A Slurm cluster (with or without containers); account, partition, ... from $QVL_EXECUTOR_CONFIG or run.executor.*."""
    return run.Config(executors.slurm, **_site_settings("slurm"))


@run.cli.factory(target=run.Executor, name="kubernetes")
def kubernetes_executor() -> run.Config:
    """A Kubeflow TrainJob; image from $QVL_EXECUTOR_CONFIG or run.executor.image=..."""
    return run.Config(executors.kubernetes, **_site_settings("kubernetes"))


_register_recipe_factories()
