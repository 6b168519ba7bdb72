"""Qwen3.5-VL recipes (and Qwen3.6 / Qwen3.8's): what the planner counts that other families do not have (Gated
DeltaNet layers, the 248,320-token vocabulary's logits), multi-token prediction on by default where Megatron-Bridge
trains it, and the vision balancing refusal shared with Qwen3-VL."""

from __future__ import annotations

import pytest

from qvl.foundation.errors import ConfigError
from qvl.recipes import activations, shapes
from qvl.recipes.planner import GIB, plan_config
from qvl.recipes.registry import all_recipes, get_recipe


def test_twenty_one_recipes_and_the_hybrid_pattern_of_the_published_sizes():
    names = {r.name for r in all_recipes() if r.family.startswith("qwen3_5_vl")}
    assert len(names) == 21 and "qwen3_5_vl_397b_a17b_peft" in names
    assert {"qwen3_6_vl_27b_sft", "qwen3_6_vl_35b_a3b_peft", "qwen3_8_vl_27b_sft"} <= names  # Qwen3.6 and Qwen3.8
    model = get_recipe("qwen3_5_vl_27b_sft").fn().model
    assert shapes.gated_delta_layers(model) == 48 and model.num_layers == 64  # 16 x (3 DeltaNet + 1 attention)
    counts = shapes.lm_param_counts(model)
    assert counts["embedding"] == counts["output"] == 248_320 * 5120  # untied, the vocabulary padded by TP already


def test_planner_counts_deltanet_state_and_the_vocabulary_logits():
    cfg = get_recipe("qwen3_5_vl_9b_sft").fn()
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
        get_recipe("qwen3_5_vl_9b_sft").fn(vision_balance=True)


@pytest.mark.parametrize(
    "name, mtp_layers",
    [
        ("qwen3_5_vl_9b_pretrain", None),  # pretraining leaves the MTP head aside
        ("qwen3_5_vl_9b_sft", 1),
        ("qwen3_6_vl_35b_a3b_peft", 1),
        ("qwen3_8_vl_27b_sft", 1),
    ],
)
def test_mtp_trains_by_default_in_sft_and_peft_at_megatron_bridges_scale(name, mtp_layers):
    model = get_recipe(name).fn().model
    assert model.mtp_num_layers == mtp_layers
    assert mtp_layers is None or model.mtp_loss_scaling_factor == 0.1
    assert get_recipe(name).fn(mtp=False).model.mtp_num_layers is None


def test_mtp_is_refused_for_a_family_without_it_and_with_context_parallelism():
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers.*drop mtp=true"):
        get_recipe("qwen3_vl_8b_sft").fn(mtp=True)
    with pytest.raises(ConfigError, match="mtp=true needs context_parallel=1"):
        get_recipe("qwen3_5_vl_9b_sft").fn(context_parallel=2)


def test_the_plan_reports_the_mtp_share_of_a_step():
    """One MTP depth of the 9B is one attention layer, its MLP, its own projections and a second 248k-vocabulary
    output layer, against 32 decoder layers, the output layer and the vision tower: about a seventh of the FLOPs."""
    cfg = get_recipe("qwen3_5_vl_9b_sft").fn()
    share = plan_config(cfg, gpus=4).mtp_share
    model = cfg.model
    h, vocab = model.hidden_size, shapes.padded_vocab(model)
    assert 2 * h * vocab / (model.num_layers * 2 * h * model.ffn_hidden_size * 3) > 0.2  # why the share is large
    assert 0.08 < share < 0.2, share
    assert plan_config(get_recipe("qwen3_5_vl_9b_sft").fn(mtp=False), gpus=4).mtp_share == 0.0
    assert plan_config(get_recipe("qwen3_5_vl_9b_pretrain").fn(), gpus=4).mtp_share == 0.0
