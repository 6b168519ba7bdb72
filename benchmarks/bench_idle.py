"""Where a training step's time goes: 2, 4, 6 and 8 packs per step in ONE run, one process, one allocator setting.

`python -m benchmarks.bench_idle [--model qwen2_5_vl_3b] [--layers 12] [--out .bench/idle]` (`gpu.sh run idle`).

An earlier estimate of the per-step fixed cost (benchmarks/RESULTS.md: 1.43 s) was a two-point fit across two
processes with different allocator settings. Here one `pretrain()` run of the RESULTS.md configuration (Qwen2.5-VL-3B
shapes, 12 LM layers, whole ViT, vision recompute, packed 4k) grows its global batch from 2 packs to 8 (Megatron-Core's
step batch-size schedule), and benchmarks/step_anatomy.py records every step: wall seconds, Megatron-Bridge's timers
at `timing_log_level=2`, `torch.cuda.memory_stats()` deltas, and on the last step of each size the GPU's busy time
from CUPTI, so idle = wall - busy. Least squares over the steps (the first of each size left out: new batch shapes,
allocator growth) split the wall and the busy time into a fixed cost per step and a cost per pack.

Megatron's timers synchronise the device at every start and stop (forward-compute and backward-compute once per
micro-batch at level 2), so the host cannot run ahead across those points: the walls here are an upper bound of a
run without timers. The goal is the issue's: GPU idle <= 5% of the step at 8 packs.

`--model tiny` runs the harness on CPU (no busy time, no allocator counters), as the test suite does.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

import numpy as np
import torch

from benchmarks import bench_train

logger = logging.getLogger(__name__)

IDLE_GOAL = 0.05  # GPU idle at most 5% of the step


def schedule_of(sizes: tuple[int, ...], steps_per_size: int) -> list[int]:
    """Packs per step: each size `steps_per_size` times, in order."""
    return [size for size in sizes for _ in range(steps_per_size)]


def fit(points: list[tuple[int, float]]) -> dict | None:
    """Least-squares `seconds = fixed + per_pack * packs` over (packs, seconds) points with two sizes or more."""
    if len({p for p, _ in points}) < 2:
        return None
    packs, seconds = np.asarray(points, dtype=float).T
    per_pack, fixed = np.polyfit(packs, seconds, 1)
    return {"fixed_s": round(float(fixed), 4), "per_pack_s": round(float(per_pack), 4), "points": len(points)}


def analyse(steps: list[dict]) -> dict:
    """Per size: mean wall, timers and idle; the fits; the goal check."""
    measured = [s for i, s in enumerate(steps) if i > 0 and steps[i - 1]["packs"] == s["packs"]]
    sizes = sorted({s["packs"] for s in measured})
    per_size = []
    for size in sizes:
        rows = [s for s in measured if s["packs"] == size]
        timers = {name: round(float(np.mean([r["timers_s"].get(name, 0.0) for r in rows])), 4)
                  for name in sorted({n for r in rows for n in r["timers_s"]})}  # fmt: skip
        row = {"packs": size, "steps": len(rows), "wall_s": round(float(np.mean([r["wall_s"] for r in rows])), 4),
               "timers_s": timers}  # fmt: skip
        busy = [r for r in rows if "gpu_busy_s" in r]
        if busy:
            row["gpu_busy_s"] = busy[-1]["gpu_busy_s"]
            row["gpu_idle_fraction"] = busy[-1]["gpu_idle_fraction"]
        if "allocator" in rows[-1]:
            row["allocator"] = rows[-1]["allocator"]
            row["peak_allocated_gib"] = rows[-1]["peak_allocated_gib"]
        per_size.append(row)
    result = {
        "per_size": per_size,
        "wall_fit": fit([(s["packs"], s["wall_s"]) for s in measured]),
        "busy_fit": fit([(s["packs"], s["gpu_busy_s"]) for s in measured if "gpu_busy_s" in s]),
    }
    largest = per_size[-1] if per_size else {}
    if "gpu_idle_fraction" in largest:
        idle = largest["gpu_idle_fraction"]
        result["checks"] = [{"figure": f"GPU idle share of the step at {largest['packs']} packs", "value": idle,
                             "goal": f"<= {IDLE_GOAL}", "met": idle <= IDLE_GOAL}]  # fmt: skip
    return result


def benchmark(setup: bench_train.Setup, *, sizes: tuple[int, ...], steps_per_size: int) -> dict:
    """Prepare, train the one growing run, analyse; writes OUT/bench_idle.json."""
    setup.out.mkdir(parents=True, exist_ok=True)
    hf_path = bench_train.write_model_dir(setup.out / "hf", setup.model, setup.layers)
    jsonl, media = bench_train.write_llava_like(
        setup.out / "samples", setup.samples, scale=1.0 if setup.model != "tiny" else 0.25
    )
    schedule = schedule_of(sizes, steps_per_size)
    setup.steps, setup.global_batch_size = len(schedule), max(sizes)
    seq_length = setup.seq_lengths[0]
    data = bench_train.prepare_dataset(setup, hf_path, jsonl, media, seq_length)
    spec_path = bench_train.variant_spec(setup, hf_path, data, seq_length, "packed")
    spec = json.loads(spec_path.read_text())
    last_of_size = [i + 1 for i, size in enumerate(schedule) if i + 1 == len(schedule) or schedule[i + 1] != size]
    spec |= {"anatomy": True, "schedule": schedule, "profiled_steps": last_of_size}
    spec_path.write_text(json.dumps(spec))
    (run,) = bench_train.train_all(setup, [spec_path])
    if "error" in run:
        raise RuntimeError(f"the training run failed: {run['error']}")
    results = {
        "model": setup.model,
        "layers": setup.layers,
        "seq_length": seq_length,
        "options": setup.options,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "schedule": schedule,
        "steps": run["steps"],
        **analyse(run["steps"]),
    }
    (setup.out / "bench_idle.json").write_text(json.dumps(results, indent=2))
    return results


def table(results: dict) -> str:
    """One line per size: wall, the main timers, GPU busy and idle."""
    lines = [f"{'packs':>5} {'wall s':>8} {'fwd-bwd s':>9} {'optim s':>8} {'busy s':>7} {'idle':>6}"]
    for row in results["per_size"]:
        t = row["timers_s"]
        busy, idle = row.get("gpu_busy_s"), row.get("gpu_idle_fraction")
        lines.append(f"{row['packs']:>5} {row['wall_s']:>8.3f} {t.get('forward-backward', 0.0):>9.3f} "
                     f"{t.get('optimizer', 0.0):>8.3f} {'-' if busy is None else f'{busy:.3f}':>7} "
                     f"{'-' if idle is None else f'{idle:.1%}':>6}")  # fmt: skip
    for name in ("wall_fit", "busy_fit"):
        if results.get(name):
            f = results[name]
            lines.append(f"{name}: {f['fixed_s']:.3f} s per step + {f['per_pack_s']:.3f} s per pack")
    for check in results.get("checks", []):
        lines.append(
            f"{check['figure']}: {check['value']} (goal {check['goal']}: {'met' if check['met'] else 'missed'})"
        )
    return "\n".join(lines)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the RESULTS.md configuration on a GPU; the tiny model on CPU (a harness check)."""
    tiny = quick or not torch.cuda.is_available()
    setup = bench_train.default_setup("tiny" if tiny else "qwen2_5_vl_3b", out_dir / "bench_idle")
    setup.variants = (bench_train.Variant(seq_length=setup.seq_lengths[0]),)  # one packed run at the first length
    results = benchmark(setup, sizes=(1, 2) if tiny else (2, 4, 6, 8), steps_per_size=2 if tiny else 4)
    if tiny:
        results["why"] = "no CUDA GPU: the tiny model on CPU (harness check; no busy time, walls are not GPU figures)"
    (out_dir / "bench_idle.json").write_text(json.dumps(results, indent=2))
    return results


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(bench_train.MODELS), default="qwen2_5_vl_3b" if gpu else "tiny")
    parser.add_argument("--layers", type=int, help="cut the language model to K layers (default 12 on a GPU)")
    parser.add_argument("--sizes", type=int, nargs="+", help="packs per step, in growing order (default 2 4 6 8)")
    parser.add_argument("--steps-per-size", type=int, default=4, help="steps at each size (the first is left out)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench/idle"))
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes or ((2, 4, 6, 8) if args.model != "tiny" else (1, 2)))
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        print(f"error: --sizes {' '.join(map(str, sizes))} must grow strictly (Megatron's loop only lets the "
              "global batch grow); e.g. --sizes 2 4 6 8", file=sys.stderr)  # fmt: skip
        return 2
    if args.steps_per_size < 2:
        print(f"error: --steps-per-size {args.steps_per_size}: at least 2 (the first of each size is left out)",
              file=sys.stderr)  # fmt: skip
        return 2
    setup = bench_train.default_setup(args.model, args.out, layers=args.layers)
    setup.variants = (bench_train.Variant(seq_length=setup.seq_lengths[0]),)  # one packed run at the first length
    results = benchmark(setup, sizes=sizes, steps_per_size=args.steps_per_size)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
