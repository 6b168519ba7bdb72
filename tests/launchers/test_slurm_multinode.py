"""qvl across two Slurm nodes (the `two_node_cluster` fixture: node1 and node2 in network namespaces of their own).

Two tiny fine-tunes are submitted together and Slurm runs them as the two nodes' CPUs allow: `qvl launch` with one
process per node (srun starts each rank; qvl's rendezvous rule) and `nemo qvl` with two per node (torchrun with c10d
on each node; `qvl launch` submits the same executor). Then the first, stopped after step 2, is requeued and must
reproduce the losses of the same run uninterrupted on two local ranks; a rank that fails on node2 must fail the job
within a bounded time, naming node2; and `launchers/ray_prepare.sbatch` (the documented recipe) must prepare
byte-identical shards with Ray on both nodes.
Selected with `-m multinode` (left out with `-m "not multinode"`).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qvl.training.loop import read_losses
from tests.run_qvl import qvl_on_two_ranks

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.slow]

QVL = str(Path(sys.executable).with_name("qvl"))
NEMO = str(Path(sys.executable).with_name("nemo"))
RECIPE = "qwen2_5_vl_3b_sft"
STEPS, STOP = 3, 2
TRAIN = {"global_batch_size": 4, "micro_batch_size": 1, "seq_length": 256, "warmup_iters": 1, "save_interval": STOP}
# A two-node CPU partition; what a job may take from the submitting shell is named, nothing else.
SITE = (
    "slurm:\n  account: qvl\n  partition: cpu\n  gpus_per_node: 0\n  exclusive: false\n  nodes: 2\n  retries: 0\n"
    "  pass_env: [QVL_TEST_PASSED]\n"
)
RAY_SCRIPT = Path(__file__).parents[2] / "launchers" / "ray_prepare.sbatch"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_qwen25_checkpoint, tiny_dataset, tiny_qwen25_megatron) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slurm2")
    site = root / "site.yaml"
    site.write_text(SITE)
    return {"root": root, "site": site, "hf": tiny_qwen25_checkpoint, "data": tiny_dataset,
            "mcore": tiny_qwen25_megatron}  # fmt: skip


def _env(cluster, **extra: str) -> dict[str, str]:
    env = os.environ | cluster.env | {"COLUMNS": "200", "NO_COLOR": "1"} | extra
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _launch(inputs, name: str, *, steps: int, per_node: int, stop: int | None = None) -> list:
    start = [f"data={inputs['data']}", f"hf_path={inputs['hf']}", f"pretrained_checkpoint={inputs['mcore']}"]
    argv = [QVL, "launch", RECIPE, *start, f"train_iters={steps}", *(f"{k}={v}" for k, v in TRAIN.items())]
    argv += [f"train.exit_interval={stop}"] if stop else []
    argv += [f"run.executor.processes_per_node={per_node}", "--model", "tiny", "--executor", "slurm"]
    argv += ["--run-dir", str(inputs["root"] / name)]
    argv += ["--executor-config", str(inputs["site"]), "--experiments-dir", str(inputs["root"] / f"exp-{name}")]
    return [*argv, "--wait", "--json"]


def _nemo(inputs, *, steps: int, per_node: int) -> list:
    """`nemo qvl finetune` without output_dir: the run goes to the job folder's run/."""
    start = {"data": inputs["data"], "hf_path": inputs["hf"], "pretrained_checkpoint": inputs["mcore"]}
    argv = [NEMO, "qvl", "finetune", "--factory", RECIPE, *(f"recipe.{k}={v}" for k, v in start.items())]
    argv += [f"recipe.{k}={v}" for k, v in (TRAIN | {"train_iters": steps}).items()]
    return argv + ["model=tiny", "run.executor=slurm", f"run.executor.processes_per_node={per_node}", "--yes"]


@pytest.fixture(scope="module")
def jobs(two_node_cluster, inputs) -> dict[str, dict]:
    """The two fine-tunes, submitted together; Slurm starts each when both nodes have its CPUs free."""
    env = _env(two_node_cluster, QVL_TEST_PASSED="yes", QVL_TEST_SECRET="not-for-the-job")
    nemo_env = env | {"QVL_EXECUTOR_CONFIG": str(inputs["site"])}
    commands = {
        "launch-2x1": (_launch(inputs, "launch-2x1", steps=STEPS, per_node=1, stop=STOP), env),
        "nemo-2x2": (_nemo(inputs, steps=STEPS, per_node=2), nemo_env | _home(inputs, "nemo-2x2")),
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(argv, env=e, cwd=inputs["root"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for name, (argv, e) in commands.items()
    }  # fmt: skip
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out[name] = proc.communicate()
    return {name: {"code": procs[name].returncode, "out": o, "err": e} for name, (o, e) in out.items()}


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch):
    """NeMo-Run runs sbatch through invoke, which reads stdin; pytest's stdin refuses reads."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())


def _home(inputs, name: str) -> dict[str, str]:
    return {"NEMORUN_HOME": str(inputs["root"] / f"exp-{name}")}


def _launched(jobs, name: str) -> dict:
    job = jobs[name]
    assert job["code"] == 0, job["err"][-3000:]
    return json.loads(job["out"])


def _nemo_job_id(inputs, name: str) -> str:
    (log,) = (inputs["root"] / f"exp-{name}" / "experiments").glob("*/*/*/sbatch_*.out")
    return log.stem.rsplit("_", 1)[-1]


def _nemo_run_dir(inputs, name: str) -> Path:
    """Where a `nemo qvl` job without output_dir writes its run: `run/` in its NeMo-Run job folder."""
    (run_dir,) = (inputs["root"] / f"exp-{name}" / "experiments").glob("*/*/*/run")
    return run_dir


def _steps(cluster, job_id: str) -> dict[str, tuple[str, int]]:
    """Job step -> (its nodes, its task count), as accounting saw them."""
    rows = cluster.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NodeList,NTasks"]).stdout.split()
    return {step: (nodes, int(tasks or 0)) for step, nodes, tasks in (row.split("|") for row in rows)}


def _assert_ran_on_both_nodes(cluster, job_id: str, tasks: int) -> None:
    """The training step (NeMo-Run's second srun; the first asks the head node's address) ran `tasks` Slurm tasks
    over node1 and node2."""
    steps = _steps(cluster, job_id)
    assert steps[f"{job_id}.1"] == ("node[1-2]", tasks), steps


def _shards(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.glob("*.distcp"))


def test_qvl_launch_one_process_per_node_trains_data_parallel_across_both_nodes(jobs, two_node_cluster, inputs):
    result = _launched(jobs, "launch-2x1")
    (job_id,) = result["job_ids"]
    assert result["states"] == ["SUCCEEDED"] and two_node_cluster.job_state(job_id) == "COMPLETED"
    _assert_ran_on_both_nodes(two_node_cluster, job_id, tasks=2)
    run_dir = inputs["root"] / "launch-2x1"
    assert sorted(read_losses(run_dir)) == [1, 2]  # stopped after step 2 as asked
    # torch_dist: one file per rank, so both ranks (one per node) wrote their shard.
    assert _shards(run_dir / "checkpoints" / f"iter_{STOP:07d}") == ["__0_0.distcp", "__1_0.distcp"]
    # The job imported the qvl packed with it: its code folder (shipped without __pycache__) now has bytecode.
    code = Path(result["folder"]) / RECIPE / "code"
    assert list((code / "qvl" / "training").glob("__pycache__/loop.*.pyc"))


def test_the_job_environment_is_the_site_file_and_what_qvl_needs(jobs, two_node_cluster, inputs):
    """sbatch sends PATH and the site file's pass_env names (plus SLURM_*), not the submitting shell's other
    variables; Slurm keeps what it was sent with the job (StateSaveLocation/hash.N/job.ID/environment)."""
    (job_id,) = _launched(jobs, "launch-2x1")["job_ids"]
    saved = two_node_cluster.root / "state" / f"hash.{int(job_id) % 10}" / f"job.{job_id}" / "environment"
    names = {entry.split("=", 1)[0] for entry in saved.read_bytes().decode().split("\0") if "=" in entry}
    assert "QVL_TEST_PASSED" in names and "PATH" in names
    assert "QVL_TEST_SECRET" not in names and "HOME" not in names and "NO_COLOR" not in names
    assert not {n for n in names if not n.startswith("SLURM")} - {"PATH", "QVL_TEST_PASSED"}, names


def test_nemo_qvl_with_two_processes_per_node_trains_four_ranks_and_writes_the_run_beside_the_job_code(
    jobs, two_node_cluster, inputs
):
    """torchrun on each node (c10d on the rule's port); without output_dir the run goes to the job folder's run/."""
    nemo = jobs["nemo-2x2"]
    assert nemo["code"] == 0, (nemo["out"] + nemo["err"])[-3000:]
    job_id = _nemo_job_id(inputs, "nemo-2x2")
    assert two_node_cluster.job_state(job_id) == "COMPLETED"
    _assert_ran_on_both_nodes(two_node_cluster, job_id, tasks=2)  # one torchrun per node, two workers each
    run_dir = _nemo_run_dir(inputs, "nemo-2x2")  # beside the job's code/, not in it
    assert not list(run_dir.parent.glob("code/runs"))
    assert sorted(read_losses(run_dir)) == list(range(1, STEPS + 1))
    assert _shards(run_dir / "checkpoints" / f"iter_{STOP:07d}") == [f"__{r}_0.distcp" for r in range(4)]


def test_a_requeued_two_node_job_resumes_and_reproduces_the_losses(jobs, two_node_cluster, inputs):
    (job_id,) = _launched(jobs, "launch-2x1")["job_ids"]
    run_dir, reference = inputs["root"] / "launch-2x1", inputs["root"] / "reference"
    two_node_cluster.requeue_now(job_id)
    # Meanwhile the same run uninterrupted on two local ranks (DP=2, as on the two nodes): the losses to reproduce.
    start = [f"data={inputs['data']}", f"hf_path={inputs['hf']}", f"pretrained_checkpoint={inputs['mcore']}"]
    train = [f"{k}={v}" for k, v in (TRAIN | {"train_iters": STEPS}).items()]
    qvl_on_two_ranks("train", RECIPE, *start, *train, "--model", "tiny", "--device", "cpu", "--run-dir", str(reference))
    deadline = time.monotonic() + 300
    while not (len(read_losses(run_dir)) == STEPS and two_node_cluster.job_state(job_id) == "COMPLETED"):
        assert time.monotonic() < deadline, (two_node_cluster.job_state(job_id), read_losses(run_dir))
        time.sleep(2)
    assert read_losses(run_dir) == pytest.approx(read_losses(reference), rel=1e-6, abs=1e-7)
    assert len((run_dir / "losses.jsonl").read_text().splitlines()) == STEPS  # step 3 only after the requeue


def test_a_rank_failing_on_one_node_fails_the_job_in_bounded_time_naming_the_node(jobs, two_node_cluster, inputs):
    """The dataset's folder vanishes on node2 only (an empty tmpfs over it in node2's mount namespace): node2's
    rank stops at its input check, srun ends node1's rank, and `qvl launch --wait` says which node failed."""
    slurmd = two_node_cluster.daemons.procs["slurmd-node2"].pid
    data = str(inputs["data"])
    subprocess.run(["nsenter", "-t", str(slurmd), "-m", "mount", "-t", "tmpfs", "tmpfs", data], check=True)
    try:
        start = time.monotonic()
        done = subprocess.run(_launch(inputs, "fail", steps=STEPS, per_node=1)[:-1], env=_env(two_node_cluster),
                              cwd=inputs["root"], capture_output=True, text=True, timeout=600)  # fmt: skip
        elapsed = time.monotonic() - start
    finally:
        subprocess.run(["nsenter", "-t", str(slurmd), "-m", "umount", data], check=True)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "ended FAILED, first on node2 (task 1: Exited with exit code 2)" in errors[0], errors[0]
    assert elapsed < 300, f"the failed job was reported after {elapsed:.0f} s"


def test_ray_prepare_across_both_nodes_writes_the_bytes_of_a_local_prepare(jobs, two_node_cluster, inputs):
    """launchers/ray_prepare.sbatch as the docs give it; the local run is the session's tiny_dataset."""
    local, out = inputs["data"], inputs["root"] / "data-ray"
    samples = local.parent / "samples"
    prepare = ["--input", str(samples / "conversations.jsonl"), "--media-root", str(samples / "images")]
    prepare += ["--family", "qwen2_5_vl", "--hf-path", str(inputs["hf"]), "--seq-length", "256", "--output", str(out)]
    log = inputs["root"] / "ray-%j.out"
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--partition=cpu", "--account=qvl", "--cpus-per-task=1"]
    # As a user submits it: from a shell where this environment's `qvl` and `ray` are first on PATH.
    env = _env(two_node_cluster, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    submitted = subprocess.run([*sbatch, f"--output={log}", str(RAY_SCRIPT), *prepare], env=env, capture_output=True,
                               text=True, check=True)  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 600
    while two_node_cluster.job_state(job_id) in ("", "PENDING", "RUNNING"):
        assert time.monotonic() < deadline, two_node_cluster.job_state(job_id)
        time.sleep(2)
    text = Path(str(log).replace("%j", job_id)).read_text(errors="replace")
    assert two_node_cluster.job_state(job_id) == "COMPLETED", text[-3000:]
    assert "preparing with Ray (2 CPUs)" in text  # one CPU of each node in the one Ray cluster
    assert "node[1-2]" in _steps(two_node_cluster, job_id)[job_id][0]
    # Every file but the random index id and the report (timings) is byte for byte the local run's.
    skip = {".nv-meta/index.uuid", "report.json"}
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == files
    assert [f for f in files if f not in skip and (local / f).read_bytes() != (out / f).read_bytes()] == []
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"ray-{job_id}"))  # the job removed Ray's folder


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("run.executor.nodes=3", "nodes=3 is more than partition cpu has (2); use nodes<=2"),
        ("run.executor.partition=gpu", "partition=gpu does not exist on this cluster; use one of cpu"),
        ("run.executor.account=nobody", "account=nobody is not a Slurm account of user root; use one of"),
        ("run.executor.processes_per_node=CPUS+1", "is more than the CPUS CPUs of a node in partition cpu"),
    ],
)
def test_a_request_this_cluster_cannot_run_is_refused_before_sbatch(
    two_node_cluster, inputs, monkeypatch, capsys, override, words
):
    from tests.launchers.test_bad_input import one_error_line

    cpus = os.cpu_count() or 1  # what each test node declares
    override, words = override.replace("CPUS+1", str(cpus + 1)), words.replace("CPUS", str(cpus))
    monkeypatch.setenv("SLURM_CONF", str(two_node_cluster.conf))
    queued = two_node_cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID"]).stdout.split()
    argv = ["launch", "demo", "steps=2", override, "--executor", "slurm", "--executor-config", str(inputs["site"])]
    line = one_error_line(capsys, [*argv, "--experiments-dir", str(inputs["root"] / "exp-refused")])
    assert words in line, line
    assert two_node_cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID"]).stdout.split() == queued
