"""Vision-tower time per rank share: the measured side of `vision_balance`'s FLOP figures (`bench_vision_parallel`).

`vision_balance` splits the images of a micro-batch over ranks by qvl's FLOP model (`qvl.foundation.cost`). Whether that
evens out *time* depends on the tower's kernels: small images may cost more than their FLOPs (launch-bound), large
ones less. This benchmark builds a real-shape HF vision tower (random weights, bf16, the varlen attention training
uses), draws LLaVA-like images (Qwen2.5-VL processor grids), and times forward + backward of:
- TP split: the images of one 8192-token pack encoded whole (what every TP rank does with the replicated tower)
  against each 1/2 share `assign_images` gives two TP ranks; measured max-share / whole next to the FLOP ratio;
- DP skew: two packs of equal tokens but unequal vision work, each replica encoding its own images (before) and
  the shares `plan_vision_balance` gives the two ranks (after); measured max/mean next to the FLOP max/mean.
Each figure is the median of `--repeats` timings with CUDA events (after warm-up), summed over `--packs` packs.

On a GPU: `python -m benchmarks.bench_vision_gpu` (benchmarks/gpu.sh runs it). `--tiny` runs a two-block tower on
CPU so the harness is tested (`tests/test_bench_vision_gpu.py`); its times are no speed figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.bench_vision_parallel import pack_images
from qvl.foundation.cost import shapes_from_hf_config, vision_flops_per_image
from qvl.training.vision_balance import assign_images, plan_vision_balance

TOWERS = {
    "qwen2_vl_2b": ("qwen2_vl", "2b"),
    "qwen2_5_vl_3b": ("qwen2_5_vl", "3b"),
}  # HF towers (Qwen3-VL's is Megatron's)
TINY = {"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 64}
GOAL_RATIO = 1.15  # the measured share ratio within 15% of what the FLOP model predicts


def build_tower(model: str, *, tiny: bool, device: torch.device, dtype: torch.dtype):
    """The model's HF vision tower (random weights) and the model's HF config; the tower attends through qvl's varlen
    function, as in training."""
    from qvl.foundation.families import get_family
    from qvl.kernels.varlen_attention import varlen_vision_towers
    from qvl.recipes.architectures import get_architecture, hf_config

    family_name, size = TOWERS[model]
    family = get_family(family_name)
    config = hf_config(get_architecture(family_name, size))
    vision = config.vision_config
    if tiny:
        for key, value in TINY.items():
            setattr(vision, key, value)
        if hasattr(vision, "fullatt_block_indexes"):
            vision.fullatt_block_indexes = [1]
        if hasattr(vision, "embed_dim"):  # Qwen2-VL names its width embed_dim and its output hidden_size
            vision.embed_dim, vision.hidden_size = TINY["hidden_size"], TINY["out_hidden_size"]
            vision.mlp_ratio = TINY["intermediate_size"] // TINY["hidden_size"]  # an int in transformers 5.12
    module = __import__(f"transformers.models.{family.hf_module}.modeling_{family.hf_module}", fromlist=["x"])
    tower = getattr(module, family.vision_tower_class)._from_config(vision).to(device=device, dtype=dtype)
    varlen_vision_towers([tower])
    return tower, config


class Timer:
    """Forward + backward of the tower over a set of images, median of `repeats` (CUDA events; wall clock on CPU)."""

    def __init__(self, tower, vision, device: torch.device, dtype: torch.dtype, repeats: int):
        self.tower, self.device, self.dtype, self.repeats = tower, device, dtype, repeats
        channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
        self.row = channels * vision.temporal_patch_size * vision.patch_size**2
        self.calls = 0
        self.seen: dict[bytes, float] = {}  # a set timed once (the whole pack recurs for TP=2 and TP=4)

    def __call__(self, grids: np.ndarray) -> float:
        """Seconds for one forward + backward over `grids` [n, 3] in one tower call."""
        if len(grids) == 0:
            return 0.0
        key = np.ascontiguousarray(grids, dtype=np.int64).tobytes()
        if key not in self.seen:
            self.seen[key] = self._time(grids)
        return self.seen[key]

    def _time(self, grids: np.ndarray) -> float:
        grid = torch.as_tensor(grids, dtype=torch.long, device=self.device)
        rows = int(grids.prod(axis=1).sum())
        pixels = torch.randn(rows, self.row, device=self.device, dtype=self.dtype)  # fresh inputs every set
        times = []
        for _ in range(self.repeats + 1):  # the first is warm-up (allocator, kernel choice for these shapes)
            self.tower.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self._step(pixels, grid)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                self._step(pixels, grid)
                times.append(time.perf_counter() - begin)
        self.calls += 1
        return statistics.median(times[1:])

    def _step(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        out = self.tower(pixels, grid_thw=grid)
        embeddings = out.pooler_output if hasattr(out, "pooler_output") else out
        if not torch.isfinite(embeddings).all():
            raise FloatingPointError("the vision tower produced non-finite embeddings")
        embeddings.float().square().mean().backward()


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tp_split(timer: Timer, shape, packs: list[np.ndarray], tp: int) -> dict:
    """Each pack encoded whole vs its `tp` shares (busiest share per pack, summed over packs)."""
    whole = share_max = flops_whole = flops_share_max = 0.0
    for index, grids in enumerate(packs):
        progress(f"TP={tp} split, pack {index + 1}/{len(packs)} ({len(grids)} images, {grids.prod(1).sum()} patches)")
        cost = vision_flops_per_image(shape, grids)
        dest = assign_images(cost, np.zeros(len(grids), np.int64), tp)
        whole += timer(grids)
        share_max += max(timer(grids[dest == r]) for r in range(tp))
        flops_whole += cost.sum()
        flops_share_max += max(cost[dest == r].sum() for r in range(tp))
    measured, predicted = share_max / whole, flops_share_max / flops_whole
    return {
        "tensor_parallel": tp,
        "packs": len(packs),
        "whole_s": round(whole, 5),
        "busiest_share_s": round(share_max, 5),
        "measured_share_over_whole": round(measured, 4),
        "flops_share_over_whole": round(predicted, 4),
        "ideal": round(1 / tp, 4),
        "met": bool(measured <= predicted * GOAL_RATIO),
    }


def dp_skew(timer: Timer, shape, packs: list[np.ndarray], pairs: int) -> dict:
    """Pairs of packs, the costliest vision pack next to the cheapest: each replica alone vs balanced over both."""
    by_cost = sorted(packs, key=lambda g: vision_flops_per_image(shape, g).sum())
    before_max = before_mean = after_max = after_mean = 0.0
    flops_before = flops_after = 0.0
    for index, (light, heavy) in enumerate(zip(by_cost[:pairs], by_cost[::-1][:pairs])):
        progress(f"DP=2 skewed pair {index + 1}/{pairs}")
        times = [timer(light), timer(heavy)]
        before_max, before_mean = before_max + max(times), before_mean + sum(times) / 2
        plan = plan_vision_balance([light, heavy], shape)
        grids = np.concatenate([light, heavy])
        shares = [timer(grids[plan.dest == r]) for r in range(2)]
        after_max, after_mean = after_max + max(shares), after_mean + sum(shares) / 2
        flops_before += plan.cost_before().max() / plan.cost_before().mean()
        flops_after += plan.cost_after().max() / plan.cost_after().mean()
    measured_after = after_max / after_mean
    return {
        "pairs": pairs,
        "measured_max_over_mean_before": round(before_max / before_mean, 4),
        "measured_max_over_mean_after": round(measured_after, 4),
        "flops_max_over_mean_before": round(flops_before / pairs, 4),
        "flops_max_over_mean_after": round(flops_after / pairs, 4),
        "busiest_replica_s_before": round(before_max, 5),
        "busiest_rank_s_after": round(after_max, 5),
        "met": bool(measured_after <= flops_after / pairs * GOAL_RATIO),
    }


def per_image(timer: Timer, shape, grids: np.ndarray) -> list[dict]:
    """Seconds per image resolution alone, next to its FLOPs: where time departs from the FLOP model."""
    rows = []
    for grid in np.unique(grids, axis=0):
        seconds = timer(grid[None])
        flops = float(vision_flops_per_image(shape, grid[None])[0])
        rows.append(
            {
                "grid_thw": grid.tolist(),
                "seconds": round(seconds, 6),
                "tflops_per_s": round(3 * flops / seconds / 1e12, 2),
            }
        )
    return rows


def benchmark(model: str, *, tiny: bool, packs: int, repeats: int, out: pathlib.Path) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tower, config = build_tower(model, tiny=tiny, device=device, dtype=dtype)
    shape = shapes_from_hf_config(config.to_dict())[1]
    all_packs = [grids for grids in pack_images(4000 if not tiny else 400, seed=0) if len(grids)]
    rng = np.random.default_rng(0)
    chosen = [all_packs[i] for i in rng.choice(len(all_packs), min(packs, len(all_packs)), replace=False)]
    if tiny:  # a sixteenth of the patches on CPU (grid sides stay even and >= 4, as the processors make them)
        chosen = [np.column_stack([g[:, 0], np.maximum(g[:, 1:] // 8 * 2, 4)]) for g in chosen]
    timer = Timer(tower, config.vision_config, device, dtype, repeats)
    timer(chosen[0])  # warm-up: the first call loads kernels
    start = time.perf_counter()
    results = {
        "model": model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "tiny": tiny,
        "repeats": repeats,
        "images_per_pack_mean": round(float(np.mean([len(g) for g in chosen])), 2),
        "tp_split": [tp_split(timer, shape, chosen, tp) for tp in (2, 4)],
        "dp_skew": dp_skew(timer, shape, chosen, pairs=max(len(chosen) // 2, 1)),
        "per_image": per_image(timer, shape, np.concatenate(chosen)),
    }
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["checks"] = [
        {"figure": f"TP={r['tensor_parallel']} busiest share / whole, measured over FLOP model",
         "value": round(r["measured_share_over_whole"] / r["flops_share_over_whole"], 3),
         "goal": f"<= {GOAL_RATIO}", "met": r["met"]}
        for r in results["tp_split"]
    ] + [
        {"figure": "DP=2 skewed pairs: balanced max/mean, measured over FLOP model",
         "value": round(results["dp_skew"]["measured_max_over_mean_after"]
                        / results["dp_skew"]["flops_max_over_mean_after"], 3),
         "goal": f"<= {GOAL_RATIO}", "met": results["dp_skew"]["met"]}
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vision_gpu.json").write_text(json.dumps(results, indent=2))
    return results


def table(results: dict) -> str:
    lines = [f"{results['model']} vision tower on {results['device']} ({results['dtype']}), fwd+bwd"]
    for row in results["tp_split"]:
        lines.append(
            f"TP={row['tensor_parallel']}: busiest share / whole {row['measured_share_over_whole']} measured, "
            f"{row['flops_share_over_whole']} by FLOPs (ideal {row['ideal']}) {'met' if row['met'] else 'MISSED'}"
        )
    skew = results["dp_skew"]
    lines.append(
        f"DP=2 skewed pairs: max/mean {skew['measured_max_over_mean_before']} -> {skew['measured_max_over_mean_after']}"
        f" measured, {skew['flops_max_over_mean_before']} -> {skew['flops_max_over_mean_after']} by FLOPs "
        f"{'met' if skew['met'] else 'MISSED'}"
    )
    return "\n".join(lines)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: CUDA only (the tiny CPU run is the test's)."""
    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU (`--tiny` runs the harness on CPU)"}
    return benchmark("qwen2_5_vl_3b", tiny=False, packs=4 if quick else 16, repeats=3, out=out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(TOWERS), default="qwen2_5_vl_3b")
    parser.add_argument("--packs", type=int, default=16, help="8192-token packs of images to time")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per set (median)")
    parser.add_argument("--tiny", action="store_true", help="a two-block tower on CPU (harness check)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("error: --model real shapes need a CUDA GPU; pass --tiny to check the harness on CPU", file=sys.stderr)
        return 2
    results = benchmark(args.model, tiny=args.tiny, packs=args.packs, repeats=args.repeats, out=args.out)
    print(table(results))
    print(f"wrote {args.out / 'bench_vision_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
