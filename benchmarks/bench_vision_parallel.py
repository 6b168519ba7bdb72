"""Vision work over the DP x TP grid (`vision_balance`): vision FLOPs per rank against the replicated HF tower, and
the bytes each rank sends, for TP in {2, 4, 8} x DP in {1, 4, 16}. Pure arithmetic over the cost model.

The mix is bench_balance's LLaVA-like one (Qwen2.5-VL processor grids, Qwen2.5-VL-7B shapes), packed into
8192-token sequences; each DP replica processes one pack per micro-batch, `MICRO_BATCHES` per step, packs drawn
at random. Per micro-batch every rank of the first stage's grid gets the assignment `vision_balance` computes at
train time (`plan_vision_balance`), and:
- "vision per rank / replicated": the busiest rank's vision FLOPs over the replicated tower's busiest rank
  (which encodes all of its replica's images on each TP rank), summed over the step's micro-batches: the vision
  time of a step whose all_to_all synchronises every micro-batch. Ideal: 1/TP.
- "max/mean": the same sum of busiest-rank FLOPs over the sum of mean-rank FLOPs (1.0 = perfectly even).
- "whole-step max/mean": what assigning all of a step's images at once would reach (DHP encodes a whole batch
  before the LM runs; qvl does not: it would hold the tower's activations for every micro-batch). A bound.
- bytes sent per rank per step (mean and max over ranks): float32 pixels leaving their replica, bf16 embeddings
  to the other TP ranks of their replica, bf16 gradients back to the encoder; self-sends are free.
GPU time (tower kernels, all_to_all latency) is not measured here.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np

from benchmarks.bench_balance import QWEN25_7B_VISION, SEQ_LENGTH, llava_like_samples
from qvl.data.pack import pack_best_fit_decreasing
from qvl.foundation.cost import vision_flops_per_image
from qvl.training.vision_balance import assign_images, bytes_sent, plan_vision_balance

TENSOR_PARALLEL = (2, 4, 8)
DATA_PARALLEL = (1, 4, 16)
MICRO_BATCHES = 16  # per replica per step
GOAL_MAX_OVER_MEAN = 1.05


def pack_images(n_samples: int, seed: int = 0) -> list[np.ndarray]:
    """The image grids [n, 3] of each 8192-token pack of the mix (packs without images included)."""
    lengths, grids, owner = llava_like_samples(n_samples, seed)
    plan = pack_best_fit_decreasing(lengths, SEQ_LENGTH)
    pack_of_sample = np.empty(len(lengths), np.int64)
    pack_of_sample[plan.order] = np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets))
    image_pack = pack_of_sample[owner]
    order = np.argsort(image_pack, kind="stable")
    bounds = np.searchsorted(image_pack[order], np.arange(plan.n_packs + 1))
    return [grids[order[bounds[p] : bounds[p + 1]]] for p in range(plan.n_packs)]


def grid_figures(packs: list[np.ndarray], tp: int, dp: int, steps: int, seed: int = 0) -> dict:
    """Vision FLOPs and bytes per rank of `steps` steps at TP=tp x DP=dp (replica d's ranks: d*tp .. d*tp+tp-1)."""
    rng = np.random.default_rng(seed)
    members = [tuple(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    replicated_max = balanced_max = balanced_mean = 0.0
    step_max_over_mean, sent_per_step, seconds, calls = [], [], 0.0, 0
    for _ in range(steps):
        step_load, step_sent, step_images, step_owner = np.zeros(dp * tp), np.zeros(dp * tp), [], []
        for _ in range(MICRO_BATCHES):
            chosen = [packs[i] for i in rng.choice(len(packs), dp, replace=False)]
            start = time.perf_counter()
            plan = plan_vision_balance(chosen, QWEN25_7B_VISION, members)
            seconds, calls = seconds + time.perf_counter() - start, calls + 1
            before, after = plan.cost_before(), plan.cost_after()
            replicated_max += before.max()
            balanced_max += after.max()
            balanced_mean += after.mean()
            step_load += after
            step_sent += bytes_sent(plan, np.concatenate(chosen).prod(axis=1), QWEN25_7B_VISION)
            step_images.append(np.concatenate(chosen))
            step_owner.append(plan.home)
        whole = np.concatenate(step_images)
        cost = vision_flops_per_image(QWEN25_7B_VISION, whole)
        dest = assign_images(cost, np.concatenate(step_owner), dp * tp)
        load = np.bincount(dest, weights=cost, minlength=dp * tp)
        step_max_over_mean.append(load.max() / load.mean())
        sent_per_step.append(step_sent)
    sent = np.asarray(sent_per_step)
    images = sum(len(p) for p in packs) / len(packs)
    return {
        "tensor_parallel": tp,
        "data_parallel": dp,
        "images_per_rank_per_micro_batch": round(images / tp, 2),
        "vision_per_rank_over_replicated": round(balanced_max / replicated_max, 4),
        "ideal": round(1 / tp, 4),
        "max_over_mean": round(balanced_max / balanced_mean, 4),
        "whole_step_max_over_mean": round(float(np.mean(step_max_over_mean)), 4),
        "mib_sent_per_rank_per_step_mean": round(float(sent.mean()) / 2**20, 1),
        "mib_sent_per_rank_per_step_max": round(float(sent.max(axis=1).mean()) / 2**20, 1),
        "plan_ms": round(seconds / calls * 1e3, 3),
    }


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Every (TP, DP) row; writes `bench_vision_parallel.json` into out_dir and returns the results."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_samples, steps = (20_000, 1) if quick else (60_000, 4)
    packs = pack_images(n_samples)
    rows = [grid_figures(packs, tp, dp, steps) for tp in TENSOR_PARALLEL for dp in DATA_PARALLEL]
    checks = [
        {
            "figure": f"TP={r['tensor_parallel']} DP={r['data_parallel']}: vision/rank vs replicated, max/mean",
            "value": f"{r['vision_per_rank_over_replicated']} (1/TP={r['ideal']}), {r['max_over_mean']}",
            "goal": f"max/mean <= {GOAL_MAX_OVER_MEAN}",
            "met": bool(r["max_over_mean"] <= GOAL_MAX_OVER_MEAN),
        }
        for r in rows
    ]
    results = {
        "quick": quick,
        "mix": {
            "samples": n_samples,
            "packs": len(packs),
            "seq_length": SEQ_LENGTH,
            "images_per_pack": round(sum(len(p) for p in packs) / len(packs), 2),
            "model": "Qwen2.5-VL-7B vision tower",
            "micro_batches_per_step": MICRO_BATCHES,
        },
        "rows": rows,
        "checks": checks,
        "why": "per micro-batch, whole images: with few images per rank (high TP, small packs) no assignment of whole "
        "images is even; 'whole_step_max_over_mean' is what step-level (DHP-style) assignment would reach",
    }
    (out_dir / "bench_vision_parallel.json").write_text(json.dumps(results, indent=2))
    return results


def _print_table(results: dict) -> None:
    print(
        f"{'TP':>3} {'DP':>3} {'img/rank':>8} {'vis/repl':>9} {'1/TP':>6} {'max/mean':>9} {'step-wide':>9} "
        f"{'MiB mean':>9} {'MiB max':>8} {'plan ms':>8}"
    )
    for r in results["rows"]:
        print(
            f"{r['tensor_parallel']:>3} {r['data_parallel']:>3} {r['images_per_rank_per_micro_batch']:>8} "
            f"{r['vision_per_rank_over_replicated']:>9} {r['ideal']:>6} {r['max_over_mean']:>9} "
            f"{r['whole_step_max_over_mean']:>9} {r['mib_sent_per_rank_per_step_mean']:>9} "
            f"{r['mib_sent_per_rank_per_step_max']:>8} {r['plan_ms']:>8}"
        )


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run, _print_table)
