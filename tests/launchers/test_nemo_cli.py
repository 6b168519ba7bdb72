"""`nemo qvl ...`: recipe factories, executor factories and checks; one real `nemo` process (~20 s of CPU), the
other commands through NeMo-Run's own command-line app in the test's process (`nemo_in_process`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Optional

import fiddle as fdl
import nemo_run as run
import pytest

from qvl.foundation.errors import LaunchError
from qvl.launchers import executors
from qvl.recipes import registry
from tests.launchers.test_launch import FAKE_RECIPE, IMAGE, fake_recipe, tiny_sft  # noqa: F401  (fixture)

NEMO = str(Path(sys.executable).with_name("nemo"))
SITE_CONFIG_ENV = "QVL_EXECUTOR_CONFIG"


@pytest.fixture
def nemo_cli(monkeypatch):
    """qvl.launchers.nemo_cli, imported (if not yet) with only the stand-in recipes registered."""
    monkeypatch.setattr(registry, "RECIPE_MODULES", ())
    return importlib.import_module("qvl.launchers.nemo_cli")


COMMANDS = {
    "help": ["finetune", "--help"],
    "real": [  # a PEFT recipe with adapter options (the SFT factories take theirs alike: "misspelt" below)
        "finetune",
        "--factory",
        "qwen2_5_vl_7b_peft",
        "recipe.tensor_parallel=4",
        "recipe.lr=1e-4",
        "recipe.adapter_rank=32",
        "recipe.adapter_targets=language,vision",
        "overrides=['train.train_iters=7']",
        "run.executor=local",
        "run.executor.gpus=0",
        "run.executor.cpu_processes=4",
        "--dryrun",
    ],
    "misspelt": [
        "finetune",
        "--factory",
        "qwen2_5_vl_7b_sft",
        "recipe.tensorparalel=2",
        "run.executor=local",
        "--dryrun",
    ],
    "dryrun": [
        "pretrain",
        "--factory",
        "demo",
        "recipe.steps=2",
        "run.executor=local",
        "run.executor.gpus=0",
        "--dryrun",
    ],
    # NEMORUN_HOME below contains /nemo_run, which NeMo-Run rewrites in a container-less sbatch script.
    "mangled": [
        "pretrain",
        "--factory",
        "demo",
        "recipe.steps=2",
        "run.executor=slurm",
        "run.executor.account=a",
        "run.executor.partition=p",
        "run.executor.gpus_per_node=0",
        "--dryrun",
    ],
}


def nemo_in_process(*args: str, home: Path | None = None, cwd: Path | None = None) -> tuple[int, str]:
    """`nemo qvl ARGS` through the app the `nemo` script runs (NeMo-Run's `create_cli`), in this process: its exit
    status and what it printed (stdout and stderr), with NEMORUN_HOME `home` and no site file. A real `nemo` spends
    ~20 s of CPU importing NeMo-Run and Megatron-Bridge; the script itself is run by the help test below."""
    from nemo_run import config
    from nemo_run.cli.api import create_cli
    from typer.testing import CliRunner

    argv, before = sys.argv, config.get_nemorun_home()
    sys.argv = ["nemo", "qvl", *args]  # create_cli adds a namespace's commands when the command line names it
    if home is not None:
        config.set_nemorun_home(str(home))
    try:
        with contextlib.chdir(cwd or Path.cwd()):
            result = CliRunner().invoke(
                create_cli(), ["qvl", *args], env={"COLUMNS": "200", "NO_COLOR": "1", SITE_CONFIG_ENV: None}
            )
    finally:
        sys.argv = argv
        config.set_nemorun_home(before)
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        output += "".join(traceback.format_exception(result.exception))
    return result.exit_code, output


@pytest.fixture(scope="module")
def nemo_runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """`finetune --help` from a real `nemo` process (the script, and its start as quiet as `qvl`), started first; the
    other commands in this process meanwhile."""
    cwd = tmp_path_factory.mktemp("nemo")
    env = os.environ | {"NEMORUN_HOME": str(cwd / "nemo_run"), "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop(SITE_CONFIG_ENV, None)
    help_args = COMMANDS["help"]
    script = subprocess.Popen(
        [NEMO, "qvl", *help_args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    runs = {name: nemo_in_process(*args, home=cwd / "nemo_run", cwd=cwd)
            for name, args in COMMANDS.items() if name != "help"}  # fmt: skip
    out = script.communicate(timeout=300)[0]
    return runs | {"help": (script.returncode, out)}


@pytest.mark.slow
def test_nemo_qvl_finetune_help_lists_factories_and_executors(nemo_runs):
    code, out = nemo_runs["help"]
    assert code == 0, out
    for name in ("demo", "local", "slurm", "kubernetes", "recipe", "overrides"):
        assert name in out
    # As quiet as `qvl`: no Megatron-Bridge import probes, fallback warnings or tracebacks before the help.
    assert out.lstrip().startswith(("Usage:", "╭", "\x1b")), out[:2000]
    for noise in ("Traceback", "UserWarning", "INFO", "Transformer Engine and Apex are not installed"):
        assert noise not in out, noise


@pytest.mark.slow
def test_nemo_qvl_takes_recipe_options_of_a_real_recipe(nemo_runs):
    code, out = nemo_runs["real"]
    assert code == 0, out
    assert "tensor_parallel=4" in out and "lr=0.0001" in out, out[-3000:]
    assert "adapter_rank=32" in out and "adapter_targets='language,vision'" in out, out[-3000:]


@pytest.mark.slow
def test_nemo_qvl_refuses_a_misspelt_recipe_option_in_one_line(nemo_runs):
    code, out = nemo_runs["misspelt"]
    assert code == 2, out
    errors = [line for line in out.splitlines() if "tensorparalel" in line]
    assert errors == [
        "error: recipe.tensorparalel: 'tensorparalel' is not a recipe option; did you mean tensor_parallel or "
        "expert_parallel?"
    ], out
    assert "Traceback" not in out and "Context:" not in out


@pytest.mark.slow
def test_nemo_qvl_dryrun_of_a_factory(nemo_runs):
    code, out = nemo_runs["dryrun"]
    assert code == 0, out
    assert "Dry run for task qvl.launchers.nemo_cli:pretrain" in out
    assert "demo(steps=2)" in out and "QVL_DEVICE" in out


@pytest.mark.slow
def test_nemo_qvl_refuses_a_nemorun_home_that_nemo_run_would_rewrite_in_one_line(nemo_runs):
    code, out = nemo_runs["mangled"]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "contains `/nemo_run`, which NeMo-Run replaces by the job folder" in errors[0], errors[0]


def test_every_registered_recipe_becomes_a_factory(fake_recipe, nemo_cli):
    from nemo_run.cli.cli_parser import parse_factory  # what `--factory NAME` calls

    nemo_cli._register_recipe_factories()
    task = parse_factory(nemo_cli.finetune, "", nemo_cli.finetune, FAKE_RECIPE)
    assert task.__fn_or_cls__ is nemo_cli.finetune and nemo_cli._recipe_name(task.recipe.__fn_or_cls__) == FAKE_RECIPE
    # `recipe.<option>=...` needs typed parameters: every recipe option is declared, with its type.
    params = inspect.signature(task.recipe.__fn_or_cls__).parameters
    assert params["tensor_parallel"].annotation == Optional[int] and params["lr"].annotation == Optional[float]
    assert parse_factory(nemo_cli.pretrain, "", nemo_cli.pretrain, "demo").recipe.__fn_or_cls__ is nemo_cli.demo


def test_a_recipes_old_spelling_is_a_factory_too(fake_recipe, nemo_cli):
    from nemo_run.cli.cli_parser import parse_factory

    registry.recipe(family="qvl_test", size="tiny", stage="sft", name="qwen9_9_vl_tiny_sft")(tiny_sft)
    try:
        nemo_cli._register_recipe_factories()
        task = parse_factory(nemo_cli.finetune, "", nemo_cli.finetune, "qwen99_vl_tiny_sft")
        assert nemo_cli._recipe_name(task.recipe.__fn_or_cls__) == "qwen9_9_vl_tiny_sft"
    finally:
        registry._RECIPES.pop("qwen9_9_vl_tiny_sft", None)


def test_recipe_command_is_the_qvl_command_line(fake_recipe, nemo_cli, monkeypatch):
    monkeypatch.delenv(executors.CPU_DEVICE_ENV, raising=False)
    recipe = functools.partial(tiny_sft, tensor_parallel=4)
    assert nemo_cli.recipe_command(recipe, ["train.train_iters=5"]) == [
        "train",
        FAKE_RECIPE,
        "tensor_parallel=4",
        "train.train_iters=5",
    ]
    monkeypatch.setenv(executors.CPU_DEVICE_ENV, "cpu")
    assert nemo_cli.recipe_command(functools.partial(nemo_cli.demo, steps=2)) == [
        "demo",
        "--steps",
        "2",
        "--device",
        "cpu",
    ]


def test_check_task_refuses_a_layout_the_executor_cannot_hold(fake_recipe, nemo_cli):
    task = run.Partial(nemo_cli.finetune, recipe=run.Partial(tiny_sft, tensor_parallel=8))
    slurm = executors.slurm(account="a", partition="p", container_image=IMAGE, nodes=3, gpus_per_node=4)
    with pytest.raises(LaunchError, match=r"world size 12 \(nodes=3 x gpus_per_node=4\) is not divisible"):
        nemo_cli.check_task(task, slurm)
    nemo_cli.check_task(task, executors.slurm(account="a", partition="p", container_image=IMAGE, nodes=2))


def test_executor_factories_take_defaults_from_the_site_file(nemo_cli, tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text(f"slurm:\n  account: acct\n  partition: batch\n  container_image: {IMAGE}\n")
    monkeypatch.setenv(SITE_CONFIG_ENV, str(site))
    config = nemo_cli.slurm_executor()
    config.nodes = 4  # what `run.executor.nodes=4` does
    executor = fdl.build(config)
    assert isinstance(executor, run.SlurmExecutor) and (executor.account, executor.nodes) == ("acct", 4)


def test_on_slurm_output_dir_defaults_to_the_job_folder_beside_its_code(nemo_cli):
    """As `qvl launch`: a Slurm job without output_dir writes its run to `<job folder>/run`, not into code/."""
    slurm = executors.slurm(account="a", partition="p", gpus_per_node=0)
    assert nemo_cli.with_default_output_dir(["recipe.lr=1e-4"], slurm) == ["recipe.lr=1e-4", "output_dir=../run"]
    assert nemo_cli.with_default_output_dir(["output_dir=/lustre/a"], slurm) == ["output_dir=/lustre/a"]
    assert nemo_cli.with_default_output_dir(["recipe.lr=1e-4"], executors.local(gpus=0)) == ["recipe.lr=1e-4"]
