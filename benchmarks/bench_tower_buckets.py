"""The rows a CUDA-graphed vision tower pads its calls with: bucket sizes planned from the dataset's packs against
the geometric grid, on packs of LLaVA-like conversations.

`python -m benchmarks.bench_tower_buckets [--out .bench] [--quick]` (also in `make bench`; about a second).

Simulated, not prepared: conversations drawn as `bench_train.write_llava_like` draws them (its resolutions, ~8%
text-only, ~5% with 2-3 images, log-normal words), each image resized by the Qwen2.5-VL processor's rule at the
pixel budget `bench_train` gives its model (`qvl.data.vision.smart_resize`, 4 to 1280 merged tokens), a token per
word plus the chat template's ~20, packed by qvl's best-fit-decreasing packer (`qvl.data.pack`). Each pack's image
patches are one tower call. For each pack length: the calls' distinct sizes, the sizes the geometric grid makes
(each one graph; more than 16 run eagerly), the graphs the grid made when slot counts told buckets apart too (the
blocks: one per image; the windows: 8 x 8 patches, the last row and column shorter), the sizes `planned_sizes`
picks (at most 16), and the rows each adds; and how many programs a full-attention layer's flash kernel launches
with the bucket's rows as its `max_seqlen` (as before) over those it launches with the graph's longest block (now:
the calls' longest images rounded up, grown as `TowerBucket.grown` grows it, in pack order): `max_seqlen / 128` per
block, the median over the calls. Last, for `bench_train`'s packed runs (64 tower calls at 4k, 40 at 8k), the share
of their calls that replay a graph (a size's first call runs eagerly, its second captures) with the sizes such a
run plans (`speed_cuda_graphs.planned_size_count`), with 16, and on the grid, packs drawn in random orders.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np

from benchmarks.bench_train import RESOLUTIONS

# `bench_train`'s real-shape packed runs: their tower calls (train_iters with the profiled steps, 8 packs each)
BENCH_TRAIN_RUNS = {4096: 8 * 8, 8192: 5 * 8}
CONVERSATIONS = 20_000
PATCH, MERGE = 14, 2  # Qwen2.5-VL
WINDOW_SIDE = 8  # a 112-pixel window of 14-pixel patches
WINDOW_ROWS = WINDOW_SIDE**2  # a graphed Qwen2.5-VL call's rows are a multiple of it
GOAL_PLANNED_PADDING = 0.02  # the planned sizes add at most 2% rows


def llava_like_calls(seq_length: int, conversations: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """(image patches, images, windows, the largest image's patches) of every pack of `conversations` LLaVA-like
    samples packed at `seq_length` (packs without images left out)."""
    from qvl.data.pack import pack_best_fit_decreasing
    from qvl.data.vision import smart_resize

    factor = PATCH * MERGE
    rng = np.random.default_rng(seed)
    lengths, images = [], []
    for _ in range(conversations):
        kind = rng.choice(3, p=[0.08, 0.87, 0.05])
        grids = []
        for _ in range([0, 1, int(rng.integers(2, 4))][kind]):
            height, width = RESOLUTIONS[rng.integers(len(RESOLUTIONS))]
            resized = smart_resize(height, width, factor, 4 * factor**2, 1280 * factor**2)
            grids.append((resized[0] // PATCH, resized[1] // PATCH))
        words = sum(int(np.clip(rng.lognormal(3.5, 0.8), 3, 600)) for _ in range(2))
        tokens = words + 20 + sum(h * w for h, w in grids) // MERGE**2
        if tokens <= seq_length:
            lengths.append(tokens)
            images.append(grids)
    plan = pack_best_fit_decreasing(np.asarray(lengths), seq_length)
    calls = []
    for k in range(plan.n_packs):
        grids = [grid for i in plan.pack(k) for grid in images[i]]
        windows = sum(-(-h // WINDOW_SIDE) * -(-w // WINDOW_SIDE) for h, w in grids)
        calls.append((sum(h * w for h, w in grids), len(grids), windows, max((h * w for h, w in grids), default=0)))
    return [call for call in calls if call[0] > 0]


def measure(shapes: list[tuple[int, int, int, int]]) -> dict:
    """What the grid and the plan make of the calls."""
    from qvl.kernels.tower_buckets import (
        MAX_GRAPHS,
        bucket_size,
        padding_share,
        planned_padding,
        planned_sizes,
        tower_bucket,
    )

    calls = [rows for rows, _, _, _ in shapes]
    by_slots = set()  # the buckets when slot counts made buckets of their own (the longest block: the bucket's rows)
    for rows, images, windows, _ in shapes:
        whole = bucket_size(rows, unit=WINDOW_ROWS)
        by_slots.add(tower_bucket(rows, images, windows, unit=WINDOW_ROWS, window=WINDOW_ROWS, longest=whole))
    planned = planned_sizes(calls, unit=WINDOW_ROWS, most=MAX_GRAPHS)
    graphs, programs = {}, []  # per call, in pack order: a block's flash programs, max_seqlen its bucket's rows
    for rows, images, windows, largest in shapes:  # over its size's graph's longest (grown as the graphs grow it)
        needed = tower_bucket(rows, images, windows, unit=WINDOW_ROWS, window=WINDOW_ROWS, longest=largest,
                              sizes=planned)  # fmt: skip
        graph = graphs.setdefault(needed.patches, needed)
        if not graph.holds(needed):
            graph = graphs[needed.patches] = graph.grown(needed)
        programs.append(-(-graph.patches // 128) / -(-graph.longest // 128))
    grid = sorted({bucket_size(c, unit=WINDOW_ROWS) for c in calls})
    return {
        "calls": len(calls),
        "rows_min_median_max": [int(min(calls)), int(np.median(calls)), int(max(calls))],
        "distinct_sizes": len(set(calls)),
        "grid_sizes": len(grid),
        "grid_graphs_by_slots": len(by_slots),
        "grid_padding_share": round(padding_share(calls, (), unit=WINDOW_ROWS), 4),
        "planned_sizes": list(planned),
        "planned_padding_share": round(padding_share(calls, planned, unit=WINDOW_ROWS), 4),
        # a run too short to replay 16 sizes plans fewer (speed_cuda_graphs.planned_size_count; bench_train's 4k
        # run of 8 steps of 8 packs: 8, its 8k run of 5: 5)
        "planned_padding_by_sizes": {
            str(most): round(planned_padding(calls, unit=WINDOW_ROWS, most=most), 4) for most in (4, 5, 8, MAX_GRAPHS)
        },
        "flash_programs_bucket_over_longest": round(float(np.median(programs)), 2),
    }


def replayed_share(calls: list[int], sizes: tuple[int, ...], run_calls: int, *, orders: int = 200) -> float:
    """The share of a run's `run_calls` tower calls (packs drawn in a random order) that replay a graph: a size's
    first call runs eagerly and its second captures. The mean over `orders` draws."""
    from qvl.kernels.tower_buckets import bucket_size

    rng = np.random.default_rng(0)
    buckets = np.asarray([bucket_size(c, unit=WINDOW_ROWS, sizes=sizes) for c in calls])
    shares = []
    for _ in range(orders):
        seen = collections.Counter(buckets[rng.permutation(len(calls))[:run_calls]].tolist())
        shares.append(sum(max(0, n - 2) for n in seen.values()) / min(run_calls, len(calls)))
    return round(float(np.mean(shares)), 3)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    from qvl.kernels.speed_cuda_graphs import CALLS_PER_SIZE
    from qvl.kernels.tower_buckets import MAX_GRAPHS, planned_sizes

    conversations = CONVERSATIONS // 4 if quick else CONVERSATIONS
    rows = {}
    for n, run_calls in BENCH_TRAIN_RUNS.items():
        shapes = llava_like_calls(n, conversations)
        rows[str(n)] = measure(shapes)
        calls = [c[0] for c in shapes]
        most = max(1, min(MAX_GRAPHS, run_calls // CALLS_PER_SIZE))
        rows[str(n)]["bench_train_run"] = {
            "tower_calls": run_calls,
            "planned_sizes": most,
            "replayed_share": {
                "planned": replayed_share(calls, planned_sizes(calls, unit=WINDOW_ROWS, most=most), run_calls),
                "16 planned": replayed_share(calls, planned_sizes(calls, unit=WINDOW_ROWS, most=MAX_GRAPHS), run_calls),
                "grid": replayed_share(calls, (), run_calls),
            },
        }
    checks = [
        {
            "figure": f"rows planned tower buckets add at {n} (SIMULATED packs)",
            "value": row["planned_padding_share"],
            "goal": f"<= {GOAL_PLANNED_PADDING}",
            "met": row["planned_padding_share"] <= GOAL_PLANNED_PADDING,
        }
        for n, row in rows.items()
    ]
    results = {"conversations": conversations, "unit_rows": WINDOW_ROWS, "per_seq_length": rows, "checks": checks}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_tower_buckets.json").write_text(json.dumps(results, indent=2))
    return results


def show(results: dict) -> None:
    print(f"{'seq':>6} {'calls':>6} {'sizes':>6} {'grid sizes':>10} {'by slots':>8} {'grid pad':>9} {'planned':>8} "
          f"{'planned pad':>11} {'programs x':>10}")  # fmt: skip
    for n, row in results["per_seq_length"].items():
        print(
            f"{n:>6} {row['calls']:>6} {row['distinct_sizes']:>6} {row['grid_sizes']:>10} "
            f"{row['grid_graphs_by_slots']:>8} {row['grid_padding_share']:>9.2%} {len(row['planned_sizes']):>8} "
            f"{row['planned_padding_share']:>11.2%} {row['flash_programs_bucket_over_longest']:>10}"
        )
    for check in results["checks"]:
        print(f"{'met' if check['met'] else 'MISSED':<7} {check['figure']}: {check['value']} (goal {check['goal']})")


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run, show)
