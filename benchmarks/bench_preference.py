"""The preference stage's speed against SFT's, measured on this machine (`python -m benchmarks.bench_preference`).

On one tiny Qwen2.5-VL and one prepared dataset of pairs (the shipped sample, seq_length 256), each command a user
would type, in a process of its own, timed by Megatron-Bridge's own per-iteration log (`elapsed time per iteration`,
the first iterations left out as warm-up) and by the reference pass's own rate line:
- the reference pass (`qvl reference`): tokens/s over the dataset, forward only (goal: at least 2.5 x the DPO training
  step's tokens/s);
- a DPO training step (`qvl train *_dpo`, its reference read from the pass's table) against an SFT step over the same
  packs (`qvl train *_sft` on the same dataset: its packs are valid SFT packs, each side learning its completion) at
  the same global batch (goal: at most 1.15 x).
On a CPU these are the tiny model's times (host overhead weighs more than on a GPU); on a GPU the same command gives
the GPU's. The step census's structural figures (vision tower calls per pair, reference forwards per step) are in
bench_step's DPO figures.
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import subprocess
import sys

from benchmarks.run import standalone

GOAL_REFERENCE_SPEEDUP = 2.5
GOAL_STEP_RATIO = 1.15
FAMILY, SFT, DPO = "qwen2_5_vl", "qwen2_5_vl_3b_sft", "qwen2_5_vl_3b_dpo"
ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
REFERENCE_RATE = re.compile(r"reference pass: \d+ / \d+ packs, [0-9.]+ packs/s, ([0-9.]+) tokens/s")
WARMUP = 2  # iterations left out of the step time


def _qvl(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "qvl.launchers.cli", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"qvl {' '.join(args[:3])} failed: {(done.stdout + done.stderr)[-1500:]}")
    return done.stdout + done.stderr


def _inputs(root: pathlib.Path, pairs: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(tiny HF checkpoint, its Megatron import, the prepared pairs), made once per output folder."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.preference_samples import write_preference_samples

    hf, megatron, data = root / "hf", root / "megatron", root / f"data-{pairs}"
    if not (hf / "config.json").is_file():
        write_tiny_hf_checkpoint(hf, FAMILY)
    if not megatron.is_dir():
        _qvl("convert", "import", str(hf), str(megatron), "--dtype", "fp32", "--device", "cpu")
    if not data.is_dir():
        jsonl, media = write_preference_samples(root / f"pairs-{pairs}", format="trl", count=pairs, with_bad=False)
        _qvl("data", "prepare", "--input", str(jsonl), "--media-root", str(media), "--family", FAMILY, "--hf-path",
             str(hf), "--seq-length", "256", "--output", str(data))  # fmt: skip
    return hf, megatron, data


def _step_ms(log: str) -> float:
    times = [float(t) for t in ITERATION.findall(log)][WARMUP:]
    if not times:
        raise RuntimeError("the training log has no per-iteration times after the warm-up")
    return statistics.median(times)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """The reference pass's and a DPO step's tokens/s, and an SFT step's on the same packs."""
    root = out_dir / "preference"
    root.mkdir(parents=True, exist_ok=True)
    hf, megatron, data = _inputs(root, pairs=24 if quick else 96)
    report = json.loads((data / "report.json").read_text())
    packs, tokens = report["packed_sequences"], report["total_tokens"]
    steps, batch = (6, 4) if quick else (12, 8)
    common = [f"data={data}", f"hf_path={hf}", f"pretrained_checkpoint={megatron}", "seq_length=256",
              f"global_batch_size={batch}", "micro_batch_size=1", f"train_iters={steps}", "warmup_iters=0",
              "log_interval=1", "save_interval=1000", "checkpoint.save=none", "--model", "tiny", "--device", "cpu"]  # fmt: skip
    reference_log = _qvl("reference", DPO, *common)
    reference_tps = float(REFERENCE_RATE.findall(reference_log)[-1])
    tokens_per_step = tokens / packs * batch
    step = {}
    for name in (DPO, SFT):
        log = _qvl("train", name, *common, "--run-dir", str(root / f"run-{name}"))
        step[name] = _step_ms(log)
    dpo_tps = tokens_per_step / (step[DPO] / 1000)
    speedup, ratio = reference_tps / dpo_tps, step[DPO] / step[SFT]
    results = {
        "machine": "cpu",
        "dataset": {"pairs": report["pairs"], "packs": packs, "tokens": tokens, "seq_length": 256},
        "reference_tokens_per_s": round(reference_tps, 1),
        "dpo_step_ms": round(step[DPO], 1),
        "sft_step_ms": round(step[SFT], 1),
        "dpo_tokens_per_s": round(dpo_tps, 1),
        "checks": [
            {
                "figure": "reference pass tokens/s over a DPO step's",
                "value": round(speedup, 2),
                "goal": f">= {GOAL_REFERENCE_SPEEDUP}",
                "met": speedup >= GOAL_REFERENCE_SPEEDUP,
            },
            {
                "figure": "DPO step time over an SFT step's (same packs)",
                "value": round(ratio, 3),
                "goal": f"<= {GOAL_STEP_RATIO}",
                "met": ratio <= GOAL_STEP_RATIO,
            },
        ],  # fmt: skip
    }
    results["goal_met"] = all(check["met"] for check in results["checks"])
    (out_dir / "bench_preference.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    standalone(__doc__, run)
