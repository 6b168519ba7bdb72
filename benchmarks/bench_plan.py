"""`qvl plan` of every Qwen3.5-family recipe at its default layout: the MFU estimate, step time, and the share of a
step's FLOPs in the multi-token-prediction layers (planner estimates on H100s, 4096-token packs; no measurement).

`python -m benchmarks.bench_plan [--out .bench]`. On CPU in seconds: the planner builds each recipe's config and
counts; figures for recipes whose MTP is on (SFT and PEFT) and off (pretraining) side by side show what MTP costs.
"""

from __future__ import annotations

import json
import pathlib

from benchmarks.run import standalone

FAMILIES = ("qwen3_5_vl", "qwen3_5_vl_moe")


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Every recipe of FAMILIES (quick: the SFT ones) planned on its registered GPU count."""
    from qvl.recipes.planner import plan_config
    from qvl.recipes.registry import all_recipes

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for info in all_recipes():
        if info.family not in FAMILIES or (quick and info.stage != "sft"):
            continue
        plan = plan_config(info.fn(), gpus=info.gpus or 8)
        rows[info.name] = {
            "gpus": plan.gpus,
            "fits": plan.fits,
            "mfu_estimate": round(plan.mfu, 4),
            "step_time_s": round(plan.step_time_s, 3),
            "mtp_share": round(plan.mtp_share, 4),
        }
    results = {"recipes": rows, "checks": []}
    (out_dir / "bench_plan.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    standalone(__doc__, run)
