"""Slurm site files as a new user writes them: no container, a CPU partition, a tiny model, and
`job_dir` / `--experiments-dir` on a local tunnel. Dry runs only; tests/launchers/test_slurm_real.py submits."""

from __future__ import annotations

import io
import os
import re
import sys

import pytest

from qvl.foundation.errors import LaunchError
from qvl.launchers import executors
from qvl.launchers.jobs import launch, resolve_job, validate
from tests.launchers.test_launch import FAKE_RECIPE, IMAGE, fake_recipe  # noqa: F401  (fixture)

BARE = ["run.executor.account=qvl", "run.executor.partition=cpu"]
# The other defects with an image set, so that each test fails for its own defect where the fix is missing.
IMAGED = [*BARE, f"run.executor.container_image={IMAGE}"]


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch):
    """NeMo-Run's Slurm packaging runs `mkdir` through invoke, which reads stdin; pytest's stdin refuses reads."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())


def _srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun --output")]
    return line


def test_slurm_without_a_container_runs_this_interpreter_in_the_job_code_folder(tmp_path):
    """Defect 1: `container_image` is optional; the job runs the submitting environment's Python."""
    result = launch("demo", ["steps=2", *BARE], kind="slurm", dryrun=True, experiments_dir=str(tmp_path))
    script, srun = result["request"], _srun_line(result["request"])
    assert "--container-image" not in srun and srun.split("--chdir ")[1].startswith(str(tmp_path))
    # torchrun per GPU node, found first on PATH in this environment's bin/
    assert f"export PATH={os.path.dirname(sys.executable)}:$PATH\n" in script and " torchrun " in srun
    cpu = launch(
        "demo", ["steps=2", "run.executor.gpus_per_node=0", *BARE], kind="slurm", dryrun=True,
        experiments_dir=str(tmp_path),
    )  # fmt: skip
    assert _srun_line(cpu["request"]).endswith(f" {sys.executable} -m qvl.launchers.cli demo --steps 2 --device cpu")
    executor = executors.slurm(account="qvl", partition="cpu", container_image="")
    assert executor.container_image is None  # "" and null both mean no container


def test_slurm_cpu_partition_is_a_cpu_job(tmp_path):
    """Defect 2: `gpus_per_node: 0` asks for no GPU, starts `processes_per_node` processes and adds --device cpu."""
    result = launch(
        "demo", ["steps=2", "run.executor.gpus_per_node=0", *IMAGED], kind="slurm", dryrun=True,
        experiments_dir=str(tmp_path),
    )  # fmt: skip
    script = result["request"]
    assert "--gpus-per-node" not in script and "#SBATCH --ntasks-per-node=1" in script
    assert _srun_line(script).endswith("demo --steps 2 --device cpu")
    assert "torchrun" not in _srun_line(script)  # one process needs no torchrun; the CPU runtime makes a world of one
    two = executors.slurm(account="qvl", partition="cpu", container_image=IMAGE, gpus_per_node=0, processes_per_node=2)
    assert executors.world_shape(two) == (1, 2) and executors.is_cpu(two) and two.launcher is not None
    assert two.cpus_per_task == 2  # torchrun's two processes run in one Slurm task


def test_slurm_cpu_layout_errors_name_processes_per_node(fake_recipe, tmp_path):  # noqa: F811
    with pytest.raises(LaunchError, match=r"world size 3 \(nodes=1 x processes_per_node=3\) is not divisible"):
        launch(
            FAKE_RECIPE, ["run.executor.gpus_per_node=0", "run.executor.processes_per_node=3", *IMAGED], kind="slurm",
            dryrun=True, experiments_dir=str(tmp_path),
        )  # fmt: skip


def test_tiny_model_needs_no_gpu_count(fake_recipe):  # noqa: F811
    """Defect 3: the recipe is registered for 8 GPUs, but `--model tiny` drops that layout (and its GPU count)."""
    tiny = resolve_job(FAKE_RECIPE, [], ["--model", "tiny"])
    for gpus in (1, 0):
        validate(tiny, executors.slurm(account="qvl", partition="cpu", container_image=IMAGE, gpus_per_node=gpus))
    with pytest.raises(LaunchError, match=r"sized for 8 GPUs but the executor has 2 \(nodes=1 x gpus_per_node=2\)"):
        validate(
            resolve_job(FAKE_RECIPE, []),
            executors.slurm(account="qvl", partition="cpu", container_image=IMAGE, gpus_per_node=2),
        )
    with pytest.raises(
        LaunchError, match=r"sized for 8 GPUs .*\(nodes=1 x torchrun_nproc_per_node=2\)"
    ):  # the setting the user wrote
        validate(
            resolve_job(FAKE_RECIPE, []),
            executors.slurm(
                account="qvl", partition="cpu", container_image=IMAGE, gpus_per_node=8, torchrun_nproc_per_node=2
            ),
        )


def test_local_job_dir_is_where_the_experiment_and_its_sbatch_script_live(tmp_path):
    """Defect 4: on a local tunnel `job_dir` is the experiments folder; NeMo-Run writes the sbatch script under
    the experiment and submits it from the tunnel's job dir, so both must be the same folder."""
    result = launch("demo", ["steps=2", f"run.executor.job_dir={tmp_path}", *IMAGED], kind="slurm", dryrun=True)
    (output,) = re.findall(r"#SBATCH --output=(\S+)", result["request"])
    assert result["folder"].startswith(str(tmp_path)) and output.startswith(result["folder"] + "/")
    same = launch(
        "demo", ["steps=2", f"run.executor.job_dir={tmp_path}", *IMAGED], kind="slurm", dryrun=True,
        experiments_dir=str(tmp_path),
    )  # fmt: skip
    assert same["folder"].startswith(str(tmp_path))
    with pytest.raises(LaunchError, match=r"job_dir=.* and --experiments-dir=.* disagree"):
        launch(
            "demo", ["steps=2", f"run.executor.job_dir={tmp_path / 'a'}", *IMAGED], kind="slurm", dryrun=True,
            experiments_dir=str(tmp_path / "b"),
        )  # fmt: skip


def test_experiments_dir_alone_moves_the_sbatch_script_too(tmp_path):
    result = launch("demo", ["steps=2", *IMAGED], kind="slurm", dryrun=True, experiments_dir=str(tmp_path))
    (output,) = re.findall(r"#SBATCH --output=(\S+)", result["request"])
    assert output.startswith(result["folder"] + "/") and result["folder"].startswith(str(tmp_path))


def test_the_real_slurm_fixture_skips_with_the_reason_where_it_cannot_install(monkeypatch):
    """Where Slurm is missing, the `slurm_cluster` fixture installs it as root with apt-get, else skips saying why."""
    from tests.launchers import slurm_cluster

    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: None)  # no Slurm, no apt-get
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(slurm_cluster.Unavailable, match=r"not installed and the tests do not run as root to apt-get"):
        slurm_cluster.install_packages()
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    with pytest.raises(
        slurm_cluster.Unavailable, match=r"no apt-get to install slurm-wlm munge slurmdbd mariadb-server"
    ):
        slurm_cluster.install_packages()


def test_the_job_environment_is_named_and_the_rendezvous_is_in_the_script(tmp_path):
    """sbatch sends PATH and the `pass_env` names only (their values never enter the script); the script exports
    the rendezvous rule's MASTER_ADDR/MASTER_PORT, and torchrun's c10d store listens on that port."""
    result = launch(
        "demo", ["steps=2", "run.executor.gpus_per_node=0", "run.executor.nodes=2", "run.executor.pass_env=[WANDB_API_KEY]",
                 *BARE], kind="slurm", dryrun=True, experiments_dir=str(tmp_path),
    )  # fmt: skip
    script = result["request"]
    assert "#SBATCH --export=PATH,WANDB_API_KEY\n" in script and "export SLURM_EXPORT_ENV=ALL\n" in script
    assert (
        "export MASTER_ADDR=$head_node\n" in script
        and "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))\n" in script
    )
    assert result["config"]["rendezvous"].startswith("slurm (2 node(s) x 1 process): srun starts each rank")
    two = launch(
        "demo", ["steps=2", "run.executor.gpus_per_node=0", "run.executor.processes_per_node=2",
                 "run.executor.nodes=2", *BARE], kind="slurm", dryrun=True, experiments_dir=str(tmp_path),
    )  # fmt: skip
    assert "--rdzv-endpoint $head_node_ip:$MASTER_PORT " in _srun_line(two["request"])
    with pytest.raises(LaunchError, match=r"pass_env=\['A=1'\]: A=1 is not a variable name; list names only"):
        executors.slurm(account="qvl", partition="cpu", pass_env=["A=1"])


def test_a_recipe_run_on_slurm_goes_to_the_job_folder_not_its_code(fake_recipe, tmp_path):  # noqa: F811
    result = launch(FAKE_RECIPE, IMAGED, kind="slurm", dryrun=True, experiments_dir=str(tmp_path))
    assert (
        _srun_line(result["request"]).endswith(" --run-dir ../run")
        and "--container-workdir /nemo_run/code" in result["request"]
    )
    given = launch(FAKE_RECIPE, IMAGED, kind="slurm", dryrun=True, experiments_dir=str(tmp_path),
                   train_flags=["--run-dir", "/lustre/runs/a"])  # fmt: skip
    assert _srun_line(given["request"]).endswith(" --run-dir /lustre/runs/a")


@pytest.mark.parametrize("where", ["experiments", "argument"])
def test_a_path_nemo_run_would_rewrite_is_refused_in_one_line(tmp_path, where):
    """Without a container NeMo-Run replaces every `/nemo_run` in the sbatch script by the job folder."""
    home = tmp_path / "nemo_run" if where == "experiments" else tmp_path
    output = f"output={tmp_path}/nemo_run/demo" if where == "argument" else "output=.demo"
    with pytest.raises(LaunchError, match=r"contains `/nemo_run`, which NeMo-Run replaces by the job folder") as err:
        launch("demo", ["steps=2", output, *BARE], kind="slurm", dryrun=True, experiments_dir=str(home))
    assert "/nemo-run" in str(err.value) and "\n" not in str(err.value)
    launch(
        "demo", ["steps=2", output, *IMAGED], kind="slurm", dryrun=True, experiments_dir=str(home)
    )  # a container mounts it
