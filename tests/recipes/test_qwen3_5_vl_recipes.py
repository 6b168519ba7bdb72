"""Qwen3.5-VL recipes: what the planner counts that other families do not have (Gated DeltaNet layers, the
248,320-token vocabulary's logits), and the vision balancing refusal shared with Qwen3-VL."""

from __future__ import annotations

import pytest

from qvl.foundation.errors import ConfigError
from qvl.recipes import activations, shapes
from qvl.recipes.planner import GIB, plan_config
from qvl.recipes.registry import all_recipes, get_recipe


def test_twelve_recipes_and_the_hybrid_pattern_of_the_published_sizes():
    names = {r.name for r in all_recipes() if r.family.startswith("qwen3_5_vl")}
    assert len(names) == 12 and "qwen35_vl_397b_a17b_peft" in names
    model = get_recipe("qwen35_vl_27b_sft").fn().model
    assert shapes.gated_delta_layers(model) == 48 and model.num_layers == 64  # 16 x (3 DeltaNet + 1 attention)
    counts = shapes.lm_param_counts(model)
    assert counts["embedding"] == counts["output"] == 248_320 * 5120  # untied, the vocabulary padded by TP already


def test_planner_counts_deltanet_state_and_the_vocabulary_logits():
    cfg = get_recipe("qwen35_vl_9b_sft").fn()
    model = cfg.model
    # fla's chunked kernel keeps a fp32 [value heads, key dim, value dim] state every 64 tokens: 2 MiB per chunk at 9B
    state_per_token = 4 * model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim / 64
    assert activations.gated_delta_bytes_per_token(model) > state_per_token == 32_768
    plan = plan_config(cfg, gpus=4)
    logits = 4096 * 4 * (model.hidden_size + shapes.padded_vocab(model)) / model.tensor_model_parallel_size
    assert logits / GIB > 0.9 and plan.stages[-1].activations > logits  # the 248k-vocabulary loss buffer is in there


def test_vision_balance_is_refused_with_the_reason():
    with pytest.raises(
        ConfigError, match="vision_balance=True is not supported for qwen3_5_vl.*tensor-parallel itself"
    ):
        get_recipe("qwen35_vl_9b_sft").fn(vision_balance=True)
