"""What `qvl plan` says about a `bench_train` run (benchmarks/train_run.py): the memory it plans next to what the run
measured, and the vision recompute a real-shape run takes from its plan on the GPU it runs on."""

from __future__ import annotations

import pathlib

import numpy as np


def planner_estimate(config, steps: list[dict], gpu: str | None) -> dict | None:
    """`qvl plan`'s per-GPU memory for the config and the workload measured in the run."""
    from qvl.recipes.planner import GIB, plan_config
    from qvl.recipes.split import Workload

    if gpu is None:
        return None
    lengths = [n for s in steps for n in s["lengths"]]
    grids = np.asarray([g for s in steps for g in s["grids"]], np.int64).reshape(-1, 3)
    merge = config.model.vision_config.spatial_merge_size
    workload = Workload(
        seq_length=config.model.seq_length,
        sample_tokens=max(int(np.mean(lengths)), 1),
        vision_token_fraction=float(grids.prod(-1).sum() / merge**2 / max(sum(lengths), 1)),
        patches_per_image=max(int(grids.prod(-1).mean()) if len(grids) else 1, 1),
    )
    plan = plan_config(config, gpus=1, gpu=gpu, workload=workload)
    worst = plan.worst
    return {
        "gpu": gpu,
        "total_gib": round(worst.total / GIB, 2),
        "params_gib": round(worst.params / GIB, 2),
        "grads_gib": round(worst.grads / GIB, 2),
        "optimizer_gib": round(worst.optimizer / GIB, 2),
        "activations_gib": round(worst.activations / GIB, 2),
        "overhead_gib": round(worst.overhead / GIB, 2),
        "mfu_estimate": round(plan.mfu, 4),
    }


# The share of the GPU's memory a benchmark run's plan may take when the plan chooses its vision recompute: the
# planner's error on measured runs was -7% (4k, vision recompute) and more than -13% (4k without, before the speed
# groups; benchmarks/RESULTS.md).
PLAN_HEADROOM = 0.85
REHEARSED_GPUS = ("h100", "h200")  # the GPU kinds `bench_train --rehearse` plans and checks its runs for (those lent)


def vision_recompute_from_plan(spec: dict, gpu: str | None) -> dict:
    """The recipe options of the fewest HF vision tower blocks recomputed (none, the first N, all) for the run's plan
    on this GPU (`qvl plan`'s, with the prepared dataset's workload) to take at most PLAN_HEADROOM of its memory;
    every block where nothing fits or the GPU is not one the planner knows. Not a Qwen2-VL / Qwen2.5-VL tower: {}."""
    from qvl.recipes.planner import GPUS, vision_recompute_that_fits
    from qvl.recipes.shapes import vision_is_megatron
    from qvl.training.loop import TrainRequest, prepare_config

    def make(options: dict):
        request = TrainRequest(recipe=spec["recipe"], overrides={**spec["overrides"], **options},
                               run_dir=pathlib.Path(spec["run_dir"]), model="tiny" if spec["tiny"] else None)  # fmt: skip
        return prepare_config(request, cpu=False)[1]

    model = make({}).model
    if vision_is_megatron(model) or getattr(model, "vision_config", None) is None:
        return {}
    if gpu is None:
        return {"vision_recompute": True}
    fitting = vision_recompute_that_fits(
        make, depth=model.vision_config.depth, limit_gib=PLAN_HEADROOM * GPUS[gpu].memory_gib, gpus=1, gpu=gpu
    )
    return {"vision_recompute": True} if fitting is None else fitting
