"""Compute balance across data-parallel ranks: max/mean rank cost of random, token-balanced and qvl's schedule.

The mix is synthetic but shaped like LLaVA-665k under Qwen2.5-VL's default processor (the mix of
`bench_data`, here with each image's grid kept): ~8% text-only, ~87% one image at a common resolution, ~5% two to
four images. Samples are packed best-fit-decreasing into 8192-token sequences and each pack costs its forward
FLOPs under Qwen2.5-VL-7B's shapes (`qvl.foundation.cost`). Per (D, packs per rank) the schedules are:
- random: a shuffled round-robin (what a shuffling loader gives);
- token-balanced: qvl's scheduler fed token counts instead of FLOPs (Megatron-Core's `dp_balanced` idea);
- qvl: `plan_dp_balanced` on FLOPs.
"max/mean" is the sum over steps of the slowest rank's cost over the sum of the mean rank cost: the slowdown a
synchronous step pays. The online part reports the vision FLOPs per rank of skewed micro-batches before and after
`assign_images`, and the assignment time per call. Vision-encoder time per rank needs a GPU (not measured here).
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np

from benchmarks.bench_data import QWEN25_VISION, RESOLUTIONS
from qvl.data.balance import imbalance, plan_dp_balanced, plan_random
from qvl.data.pack import pack_best_fit_decreasing
from qvl.data.vision import image_grid_thw
from qvl.foundation.cost import lm_flops_per_sequence, sample_flops, vision_flops_per_image
from qvl.recipes.architectures import cost_shapes
from qvl.training.vision_balance import assign_images

SEQ_LENGTH = 8192
DATA_PARALLEL = (8, 32, 128)
PACKS_PER_RANK = (4, 16)
QWEN25_7B_LM, QWEN25_7B_VISION = cost_shapes("qwen2_5_vl", "7b")  # Qwen2.5-VL-7B-Instruct's config.json


def llava_like_samples(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token lengths [n], image grids [m, 3], owning sample per image [m]) of n synthetic samples."""
    rng = np.random.default_rng(seed)
    grids = np.asarray([image_grid_thw(h, w, QWEN25_VISION) for h, w in RESOLUTIONS], dtype=np.int64)
    kind = rng.choice(3, size=n, p=[0.08, 0.87, 0.05])  # text-only, one image, multi-image
    images = np.where(kind == 0, 0, np.where(kind == 1, 1, rng.integers(2, 5, size=n)))
    owner = np.repeat(np.arange(n), images)
    image_grids = grids[rng.integers(0, len(grids), size=len(owner))]
    image_tokens = np.bincount(owner, weights=image_grids.prod(axis=1) // 4 + 2, minlength=n).astype(np.int64)
    text = np.clip(rng.lognormal(mean=5.0, sigma=0.9, size=n), 20, 3500).astype(np.int64) + 20
    return text + image_tokens, image_grids, owner


def pack_costs(n_samples: int, seed: int = 0) -> dict:
    """Packs of the mix with their FLOPs, tokens and sample counts."""
    lengths, grids, owner = llava_like_samples(n_samples, seed)
    plan = pack_best_fit_decreasing(lengths, SEQ_LENGTH)
    pack_of_slot = np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets))
    cost = sample_flops(QWEN25_7B_LM, QWEN25_7B_VISION, lengths, grids, owner)
    return {
        "cost": np.bincount(pack_of_slot, weights=cost[plan.order]),
        "tokens": plan.pack_tokens(lengths),
        "samples": np.diff(plan.offsets),
        "n_samples": n_samples,
    }


def schedule_balance(packs: dict, steps: int) -> list[dict]:
    """Max/mean rank cost of the three schedules, and qvl's planning time, per (D, packs per rank)."""
    rows = []
    plan_dp_balanced(packs["cost"][:256], 8, 32)  # warm numpy up, so the first row's time is not import cost
    for data_parallel in DATA_PARALLEL:
        for per_rank in PACKS_PER_RANK:
            global_batch_size = data_parallel * per_rank
            n = min(len(packs["cost"]), steps * global_batch_size)
            cost, tokens = packs["cost"][:n], packs["tokens"][:n]
            start = time.perf_counter()
            qvl = plan_dp_balanced(cost, data_parallel, global_batch_size)
            seconds = time.perf_counter() - start
            n_steps = qvl.n_steps
            samples_per_batch = packs["samples"][:n].sum() / max(n_steps, 1)
            rows.append(
                {
                    "data_parallel": data_parallel,
                    "packs_per_rank": per_rank,
                    "global_batch_size": global_batch_size,
                    "steps": n_steps,
                    "random": imbalance(plan_random(n, data_parallel, global_batch_size), cost)["time_over_ideal"],
                    "token_balanced": imbalance(plan_dp_balanced(tokens, data_parallel, global_batch_size), cost)[
                        "time_over_ideal"
                    ],
                    "qvl": imbalance(qvl, cost)["time_over_ideal"],
                    "qvl_worst_step": imbalance(qvl, cost)["worst_max_over_mean"],
                    "ms_per_global_batch": round(seconds / max(n_steps, 1) * 1e3, 3),
                    "samples_per_global_batch": round(float(samples_per_batch)),
                    "ms_per_1k_samples": round(seconds / max(n_steps, 1) * 1e3 / (samples_per_batch / 1000), 3),
                }
            )
    return rows


def online_vision_balance(n_batches: int = 50, data_parallel: int = 8, seed: int = 0) -> dict:
    """Vision FLOPs per rank of micro-batches of 8192 tokens each, before and after `assign_images`."""
    lengths, grids, owner = llava_like_samples(20_000, seed)
    plan = pack_best_fit_decreasing(lengths, SEQ_LENGTH)
    image_cost = vision_flops_per_image(QWEN25_7B_VISION, grids)
    sample_vision = np.bincount(owner, weights=image_cost, minlength=len(lengths))
    pack_vision = np.bincount(
        np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets)), weights=sample_vision[plan.order]
    )
    rng = np.random.default_rng(seed)
    before, after, seconds, moved = [], [], 0.0, 0
    pack_of_sample = np.empty(len(lengths), np.int64)
    pack_of_sample[plan.order] = np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets))
    image_pack = pack_of_sample[owner]
    for _ in range(n_batches):
        # Token-balanced ranks (one full pack each), but the costliest vision pack lands on one rank: the skew.
        chosen = rng.choice(plan.n_packs, data_parallel, replace=False)
        chosen[0] = int(np.argmax(pack_vision))
        images = np.concatenate([np.flatnonzero(image_pack == p) for p in chosen])
        image_owner = np.repeat(np.arange(data_parallel), [int((image_pack == p).sum()) for p in chosen])
        start = time.perf_counter()
        dest = assign_images(image_cost[images], image_owner, data_parallel)
        seconds += time.perf_counter() - start
        moved += int((dest != image_owner).sum())
        load_before = np.bincount(image_owner, weights=image_cost[images], minlength=data_parallel)
        load_after = np.bincount(dest, weights=image_cost[images], minlength=data_parallel)
        before.append(load_before.max() / load_before.mean())
        after.append(load_after.max() / load_after.mean())
    return {
        "data_parallel": data_parallel,
        "micro_batches": n_batches,
        "vision_max_over_mean_before": round(float(np.mean(before)), 4),
        "vision_max_over_mean_after": round(float(np.mean(after)), 4),
        "images_moved_per_batch": round(moved / n_batches, 1),
        "assign_ms": round(seconds / n_batches * 1e3, 3),
        "gpu_encoder_time": "not measured (no GPU in this run)",
    }


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Run the balance benchmarks; write `bench_balance.json` into out_dir and return the results."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_samples, steps = (60_000, 2) if quick else (400_000, 8)
    packs = pack_costs(n_samples)
    lm_share = float(lm_flops_per_sequence(QWEN25_7B_LM, packs["tokens"]).sum() / packs["cost"].sum())
    results = {
        "quick": quick,
        "mix": {
            "samples": n_samples,
            "packs": int(len(packs["cost"])),
            "seq_length": SEQ_LENGTH,
            "model": "Qwen2.5-VL-7B shapes",
            "pack_cost_cv": round(float(packs["cost"].std() / packs["cost"].mean()), 4),
            "lm_share_of_flops_upper_bound": round(lm_share, 4),
        },
        "schedules": schedule_balance(packs, steps),
        "online_vision": online_vision_balance(n_batches=10 if quick else 50),
        "goals": {"max_over_mean_at_16_per_rank": 1.02, "max_over_mean_at_4_per_rank": 1.10, "ms_per_1k_samples": 5.0},
    }
    (out_dir / "bench_balance.json").write_text(json.dumps(results, indent=2))
    return results


def _print_table(results: dict) -> None:
    print(
        f"{'D':>4} {'G/D':>4} {'steps':>5} {'random':>8} {'tokens':>8} {'qvl':>8} {'worst':>8} {'ms/batch':>9} "
        f"{'ms/1k':>7}"
    )
    for r in results["schedules"]:
        print(
            f"{r['data_parallel']:>4} {r['packs_per_rank']:>4} {r['steps']:>5} {r['random']:>8.4f} "
            f"{r['token_balanced']:>8.4f} {r['qvl']:>8.4f} {r['qvl_worst_step']:>8.4f} "
            f"{r['ms_per_global_batch']:>9.2f} {r['ms_per_1k_samples']:>7.3f}"
        )
    online = results["online_vision"]
    print(
        f"online vision, D={online['data_parallel']}: max/mean {online['vision_max_over_mean_before']} -> "
        f"{online['vision_max_over_mean_after']}, {online['images_moved_per_batch']} images moved, "
        f"{online['assign_ms']} ms per assignment"
    )


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run, _print_table)
