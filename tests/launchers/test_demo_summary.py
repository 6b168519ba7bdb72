"""`qvl demo`'s summary reads at 80 columns: one line per stage, nothing folded into a column of fragments."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from qvl.launchers.demo import summary_table

PLAN = {"fits": True, "gib_per_gpu": 61.17, "mfu_estimate": 0.4804, "layout": {}, "problems": []}


def test_the_summary_fits_80_columns_one_line_per_stage(tmp_path):
    out = tmp_path / "a-fairly-long-output-folder-name" / ".demo"
    verify = {"max_abs_diff": 1.5e-07, "tensors_compared": 105, "ok": True}
    results = {
        "output": str(out),
        "prepare data": {"seconds": 12.3, "artifact": str(out / "data")},
        "convert HF -> Megatron": {"seconds": 20, "artifact": str(out / "megatron")},
        "verify conversion": {"seconds": 30, "artifact": "", "report": verify},
        "plan (7B SFT, 8 x H100)": {"seconds": 9, "artifact": "", "plan": PLAN},
        "train (SFT, tiny)": {"seconds": 160, "artifact": str(out / "train")},
        "export SFT -> HF": {"seconds": 20, "artifact": str(out / "export")},
        "verify SFT export": {"seconds": 25, "artifact": "", "report": verify},
    }
    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(summary_table(results, out, {"accepted": 48, "quarantined": 3}, {1: 6.349, 20: 4.905}, Table))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    for stage in (k for k in results if k != "output"):
        (row,) = [line for line in lines if line.strip().startswith(stage)]  # the whole name on one line
        assert row
    assert any("loss 6.349 -> 4.905, 2 steps" in line and "train/" in line for line in lines)
    assert any(line.strip().startswith("plan") and "fits, 61.2 GiB/GPU, MFU est. 48%" in line for line in lines)
    assert sum("max diff 1e-07, 105 tensors ok" in line for line in lines) == 2  # each verification on its line
    assert not any(str(Path(out)) in line for line in lines[1:])  # artifacts relative to the output folder


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
    assert [s.name for s in stages][:3] == ["prepare pairs", "reference (the SFT model)", "train (DPO, tiny)"]
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
