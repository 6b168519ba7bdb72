"""`qvl recipes` and `qvl plan` through the real `qvl` entry point."""

from __future__ import annotations

import pytest

from qvl.launchers.cli import main
from qvl.recipes.overrides import parse_overrides, parse_value


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # rich reads it; tables are not truncated


def test_values_parse_to_python_types():
    assert [parse_value(v) for v in ("4", "0.6", "true", "None", "vision,projector")] == [
        4,
        0.6,
        True,
        None,
        "vision,projector",
    ]
    assert parse_overrides(["tensor_parallel=4", "freeze=vision"]).as_dict() == {
        "tensor_parallel": 4,
        "freeze": "vision",
    }
    with pytest.raises(ValueError, match="is not key=value"):
        parse_overrides(["tensor_parallel"]).as_dict()


def test_qvl_recipes_lists_every_recipe(capsys):
    assert main(["recipes", "--family", "qwen3_vl_moe"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_vl_235b_a22b_peft" in out and "qwen3_vl_30b_a3b_sft" in out
    assert "qwen2_5_vl" not in out and "qwen3_vl_8b" not in out


def test_qvl_plan_prints_memory_split_flops_and_mfu(capsys):
    assert main(["plan", "qwen2_5_vl_72b_sft", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    for text in ("params GiB", "optimizer GiB", "activations GiB", "pipeline split", "MFU estimate", "FLOPs per step"):
        assert text in out


def test_qvl_plan_refuses_and_suggests(capsys):
    assert main(["plan", "qwen2_5_vl_7b_sft", "--gpus", "2"]) == 1
    out = capsys.readouterr().out
    assert "refused" in out and "offload" in out
    assert main(["plan", "qwen2_5_vl_7b_sft", "tensor_parallel=3"]) == 2
    assert "tensor_parallel=3" in capsys.readouterr().err
