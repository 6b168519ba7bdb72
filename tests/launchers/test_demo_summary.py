"""`qvl demo`'s summary reads at 80 columns: one line per stage, nothing folded into a column of fragments."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from qvl.launchers.demo import summary_table

PLAN = {"fits": True, "gib_per_gpu": 61.17, "mfu_estimate": 0.4804, "layout": {}, "problems": []}


@pytest.mark.parametrize("dpo", [False, True], ids=["sft", "dpo"])
def test_the_summary_fits_80_columns_one_line_per_stage(tmp_path, dpo):
    out = tmp_path / "a-fairly-long-output-folder-name" / ".demo"
    verify = {"max_abs_diff": 1.5e-07, "tensors_compared": 105, "ok": True}
    results = {
        "output": str(out),
        "prepare data": {"seconds": 12.3, "artifact": str(out / "data")},
        "import HF -> Megatron": {"seconds": 20, "artifact": str(out / "megatron")},
        "verify conversion": {"seconds": 30, "artifact": "", "report": verify},
        "plan (7B, 8 x H100)": {"seconds": 9, "artifact": "", "plan": PLAN},
        "train (SFT, 20 steps)": {"seconds": 160, "artifact": str(out / "train")},
        "export SFT -> HF": {"seconds": 20, "artifact": str(out / "export")},
        "verify SFT export": {"seconds": 25, "artifact": "", "report": verify},
    }
    if dpo:  # the longest artifact path: the reference table inside the pairs' dataset
        results |= {
            "prepare pairs": {"seconds": 11, "artifact": str(out / "dpo-data")},
            "reference log-probs": {"seconds": 15, "artifact": str(out / "dpo-data" / "reference")},
            "train (DPO, 20 steps)": {"seconds": 136, "artifact": str(out / "dpo")},
            "export DPO -> HF": {"seconds": 16, "artifact": str(out / "dpo-export")},
            "verify DPO export": {"seconds": 19, "artifact": "", "report": verify},
            "dpo": [{"loss": 0.6931, "reward_accuracy": 0.0}, {"loss": 0.2104, "reward_accuracy": 1.0}],
            "pairs": {"accepted": 24, "quarantined": 5},
        }
    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(summary_table(results, out, {"accepted": 48, "quarantined": 3}, {1: 6.349, 20: 4.905}, Table))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    stages = [k for k, v in results.items() if isinstance(v, dict) and "seconds" in v]
    rule = next(i for i, line in enumerate(lines) if line.strip().startswith("───"))
    rows = [line for line in lines[rule + 1 :] if line.strip()]
    assert len(rows) == len(stages)  # no result folded onto a second line
    for stage, row in zip(stages, rows, strict=True):
        assert row.strip().startswith(stage), (stage, row)  # the whole name on its own row
    assert any("loss 6.349 -> 4.905" in line and "train/" in line for line in lines)
    assert any(line.strip().startswith("plan") and "61.2 GiB/GPU, MFU ~48%" in line for line in lines)
    assert sum("ok, max diff 1e-07" in line for line in lines) == (3 if dpo else 2)  # each verification on its line
    assert not any(str(Path(out)) in line for line in lines[1:])  # artifacts relative to the output folder
    if dpo:
        assert any("loss 0.69 -> 0.21, acc 1.00" in line and "dpo/" in line for line in lines)
        assert any("24 kept, 5 quarantined" in line for line in lines)
        assert any("dpo-data/reference/" in line for line in lines)


def test_every_family_has_a_demo_its_tiny_sft_and_a_planned_size():
    from qvl.foundation.families import FAMILIES
    from qvl.launchers.demo import demo_recipes
    from qvl.recipes.registry import get_recipe

    assert demo_recipes("qwen2_5_vl") == demo_recipes("qwen2_5_vl").__class__(
        family="qwen2_5_vl", trained="qwen2_5_vl_3b_sft", planned="qwen2_5_vl_7b_sft", plan_size="7B", plan_gpus=8
    )
    for family in FAMILIES:
        recipes = demo_recipes(family)
        assert get_recipe(recipes.trained).family == get_recipe(recipes.planned).family == family
        assert get_recipe(recipes.trained).stage == "sft" and recipes.plan_gpus >= 1


def test_the_dpo_stages_are_commands_qvl_parses_and_train_from_the_sft_run(tmp_path):
    """`qvl demo --stage dpo`'s stages: each a `qvl` command its parser takes, reading the SFT stages' outputs."""
    from qvl.launchers.cli import build_parser
    from qvl.launchers.demo import demo_recipes, preference_stages

    out = tmp_path / ".demo"
    stages = preference_stages(out, ["--device", "cpu"], 4, demo_recipes("qwen3_vl"))
    assert [s.name for s in stages][:3] == ["prepare pairs", "reference log-probs", "train (DPO, 4 steps)"]
    for stage in stages:
        build_parser().parse_args(stage.args)
    reference, train = stages[1].args, stages[2].args
    assert reference[:2] == ["reference", "qwen3_vl_2b_dpo"] and train[:2] == ["train", "qwen3_vl_2b_dpo"]
    assert f"pretrained_checkpoint={out / 'train' / 'checkpoints'}" in reference and set(reference[2:6]) <= set(train)
    assert (out / "pairs" / "pairs-trl.jsonl").is_file()  # the sample pairs the prepare stage reads


def test_the_plan_stage_keeps_what_qvl_plan_json_says():
    """The demo's plan row comes from `qvl plan --json` (the same dict: `plan_dict`): the fullest stage's GiB per GPU,
    whether it fits, the MFU estimate."""
    from qvl.launchers.commands.recipes import plan_dict
    from qvl.launchers.demo import demo_recipes, plan_summary
    from qvl.recipes.planner import plan_recipe

    recipes = demo_recipes("qwen2_5_vl")
    plan = plan_recipe(recipes.planned, {}, gpus=recipes.plan_gpus, gpu="h100")
    summary = plan_summary(plan_dict(recipes.planned, plan))
    assert summary["fits"] is plan.fits is True and summary["problems"] == []
    assert summary["gib_per_gpu"] == pytest.approx(max(s.total for s in plan.stages) / 2**30, abs=1e-3)
    assert summary["mfu_estimate"] == plan.mfu and summary["layout"] == plan.layout
