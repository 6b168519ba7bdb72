"""qvl on a real Slurm (the `slurm_cluster` fixture: one node, CPU partition, no containers, accounting on).

Two training jobs run side by side: `qvl launch --wait` stops after step 3 (`train.exit_interval=3`, saving a
checkpoint), `nemo qvl finetune` runs all 6 steps. `scontrol requeue` of the first then resumes from its checkpoint
and must reproduce the second's losses. A job that fails in the queue and an sbatch that refuses the request each
end in one `error:` line and exit status 2. Selected with `-m slurm`; they add about 3 minutes (plus the apt install
on a machine without the packages).
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

from qvl.training.train import read_losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

QVL = str(Path(sys.executable).with_name("qvl"))
NEMO = str(Path(sys.executable).with_name("nemo"))
RECIPE = "qwen25_vl_3b_sft"
STEPS, STOP = 6, 3
TRAIN = {
    "train_iters": STEPS,
    "global_batch_size": 2,
    "micro_batch_size": 1,
    "seq_length": 256,
    "warmup_iters": 1,
    "save_interval": STOP,
}
# A CPU partition without pyxis: what the README's bare-Slurm example shows.
CPU_SITE = "slurm:\n  account: qvl\n  partition: cpu\n  gpus_per_node: 0\n  exclusive: false\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A prepared sample dataset, a tiny Qwen2.5-VL checkpoint and its Megatron import that both fine-tunes start
    from, and the CPU site file."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main

    root = tmp_path_factory.mktemp("slurm-inputs")
    jsonl, media = write_sample_dataset(root / "samples", count=16, with_bad=False)
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen2_5_vl")
    prepare = ["data", "prepare", "--input", str(jsonl), "--media-root", str(media), "--family", "qwen2_5_vl"]
    prepare += ["--hf-path", str(hf), "--seq-length", "256", "--output", str(root / "data")]
    assert main(prepare) == 0
    assert main(["convert", "import", str(hf), str(root / "mcore")]) == 0
    site = root / "site.yaml"
    site.write_text(CPU_SITE)
    return {"data": root / "data", "hf": hf, "mcore": root / "mcore", "site": site, "root": root}


@pytest.fixture(scope="module")
def jobs(slurm_cluster, inputs) -> dict[str, dict]:
    """Both training jobs, submitted together (each spends ~20 s importing Megatron before it trains)."""
    root = inputs["root"]
    env = _job_env(slurm_cluster)
    start = [f"data={inputs['data']}", f"hf_path={inputs['hf']}", f"pretrained_checkpoint={inputs['mcore']}"]
    launch = [QVL, "launch", RECIPE, *start]
    launch += [f"{k}={v}" for k, v in TRAIN.items()] + [f"train.exit_interval={STOP}", "--model", "tiny"]
    launch += ["--run-dir", str(root / "run-a"), "--executor", "slurm", "--executor-config", str(inputs["site"])]
    launch += ["--experiments-dir", str(root / "exp-a"), "--wait", "--json"]
    nemo = [NEMO, "qvl", "finetune", "--factory", RECIPE, *(f"recipe.{pair}" for pair in start)]
    nemo += [f"recipe.{k}={v}" for k, v in TRAIN.items()]
    nemo += ["model=tiny", f"output_dir={root / 'run-b'}", "run.executor=slurm", "--yes"]
    nemo_env = env | {"QVL_EXECUTOR_CONFIG": str(inputs["site"]), "NEMORUN_HOME": str(root / "exp-b")}
    procs = {
        "launch": subprocess.Popen(launch, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "nemo": subprocess.Popen(nemo, env=nemo_env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }  # fmt: skip
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            proc.kill()
            out[name] = proc.communicate()
    return {name: {"code": procs[name].returncode, "out": o, "err": e or ""} for name, (o, e) in out.items()}


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch, slurm_cluster):
    """NeMo-Run runs sbatch through invoke, which reads stdin; pytest's stdin refuses reads. sbatch and sacct run
    in this process reach the one-node cluster."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))


def _job_env(cluster) -> dict[str, str]:
    env = os.environ | cluster.env | {"COLUMNS": "200", "NO_COLOR": "1"}
    # sbatch hands the job this environment: with bytecode on, the job leaves __pycache__ where it imported qvl.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _job_ids(cluster, name_part: str) -> list[str]:
    rows = cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID,JobName"]).stdout.split()
    return [row.split("|")[0] for row in rows if name_part in row]


def test_qvl_launch_runs_a_tiny_recipe_on_a_cpu_partition_without_a_container(jobs, slurm_cluster, inputs):
    launch = jobs["launch"]
    assert launch["code"] == 0, launch["err"][-3000:]
    result = json.loads(launch["out"])
    assert result["states"] == ["SUCCEEDED"]
    (job_id,) = result["job_ids"]
    assert slurm_cluster.job_state(job_id) == "COMPLETED"
    run_dir = inputs["root"] / "run-a"
    assert sorted(read_losses(run_dir)) == [1, 2, 3]  # stopped after step 3 as asked
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STOP)
    # The job imported the qvl packed with it: its code folder (shipped without __pycache__) now has bytecode.
    code = Path(result["folder"]) / RECIPE / "code"
    assert (code / "qvl" / "launchers" / "cli.py").is_file()
    assert list((code / "qvl" / "training").glob("__pycache__/train.*.pyc"))


def test_nemo_qvl_finetune_runs_on_slurm(jobs, slurm_cluster, inputs):
    nemo = jobs["nemo"]
    assert nemo["code"] == 0, nemo["out"][-3000:]
    (job_id,) = _job_ids(slurm_cluster, "finetune")
    assert slurm_cluster.job_state(job_id) == "COMPLETED"
    run_dir = inputs["root"] / "run-b"
    assert sorted(read_losses(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints").is_dir()
    experiments = inputs["root"] / "exp-b" / "experiments"
    assert list(experiments.glob("*/*/*/code/qvl/training/__pycache__/train.*.pyc"))


def test_requeue_resumes_from_the_checkpoint_and_reproduces_the_losses(jobs, slurm_cluster, inputs):
    job_id = json.loads(jobs["launch"]["out"])["job_ids"][0]
    run_a, run_b = inputs["root"] / "run-a", inputs["root"] / "run-b"
    slurm_cluster.requeue_now(job_id)
    deadline = time.monotonic() + 240
    while not (len(read_losses(run_a)) == STEPS and slurm_cluster.job_state(job_id) == "COMPLETED"):
        assert time.monotonic() < deadline, (slurm_cluster.job_state(job_id), read_losses(run_a))
        time.sleep(2)
    resumed, uninterrupted = read_losses(run_a), read_losses(run_b)
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-7)
    assert len((run_a / "losses.jsonl").read_text().splitlines()) == STEPS  # steps 4-6 only after the requeue


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
    from qvl.launchers.cli import main

    code = main(
        ["launch", "demo", "steps=2", "run.executor.partition=no-such-partition", "--executor", "slurm",
         "--executor-config", str(inputs["site"]), "--experiments-dir", str(inputs["root"] / "exp-refused")]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: sbatch refused") and "invalid partition" in err[0].lower(), err


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
