"""CPU seconds of `qvl launch --dryrun` for the 7B SFT recipe on Slurm (goal: at most 5 s), and what it spends them on.

`python -m benchmarks.bench_dryrun [--out .bench]`. Each figure is one fresh process (the command as a user runs it),
timed by the CPU it and its children used (user + system), so a busy machine inflates it less than wall time. The
breakdown: the `qvl` command line's imports, the dry run itself (NeMo-Run renders the sbatch script; most of its
CPU is importing NeMo-Run, which imports torch), and, for comparison, Megatron-Bridge's import and the dry run with
`--resolve`, which builds and prints the job's ConfigContainer and so imports Megatron-Bridge.
"""

from __future__ import annotations

import pathlib
import resource
import subprocess
import sys

from benchmarks.run import standalone

GOAL_CPU_S = 5.0
RECIPE = "qwen2_5_vl_7b_sft"
DRYRUN = [
    "-m", "qvl.launchers.cli", "launch", RECIPE, "data=/lustre/data/llava-4k", "hf_path=/lustre/hf/Qwen2.5-VL-7B",
    "pretrained_checkpoint=/lustre/ckpt/qwen25-7b", "--executor", "slurm", "run.executor.account=ml",
    "run.executor.partition=batch", "run.executor.container_image=nvcr.io/nvidia/nemo:25.09", "--dryrun",
]  # fmt: skip
STAGES = {
    "python_and_qvl_cli": ["-c", "import qvl.launchers.cli"],
    "megatron_bridge_import": ["-c", "from qvl.foundation import megatron; megatron.import_megatron_bridge()"],
    "dryrun_7b_sft": DRYRUN,
    "dryrun_resolve_7b_sft": [*DRYRUN, "--resolve"],
}


def cpu_seconds(argv: list[str], cwd: pathlib.Path) -> float:
    """User + system CPU seconds of `python ARGV` and its children; raises if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Each stage once (twice unless quick, keeping the lower: the first may also fill the OS page cache)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = 1 if quick else 2
    stages = {name: min(cpu_seconds(argv, out_dir) for _ in range(repeats)) for name, argv in STAGES.items()}
    total = stages["dryrun_7b_sft"]
    return {
        "cpu_s": stages,
        "checks": [
            {
                "figure": f"qvl launch {RECIPE} --executor slurm --dryrun, CPU s",
                "value": total,
                "goal": f"<= {GOAL_CPU_S}",
                "met": total <= GOAL_CPU_S,
            }
        ],  # fmt: skip
        "goal_met": total <= GOAL_CPU_S,
    }


if __name__ == "__main__":
    standalone(__doc__, run)
