"""What a Megatron-Bridge Qwen-VL provider holds, counted without building it: its cost-model shapes
(`qvl.foundation.cost`), its family, and its language-model and vision-tower parameters (the planner's and the
training benchmark's counts; `tests/recipes/test_planner.py` checks them against built models)."""

from __future__ import annotations

import math
from typing import Any

from qvl.foundation.cost import LMShape, VisionShape, shapes_from_hf_config
from qvl.foundation.families import FAMILIES, Family, family_of_vision_config


def model_shapes(model: Any) -> tuple[LMShape, VisionShape]:
    """qvl.foundation.cost shapes of a Megatron-Bridge Qwen-VL provider (its LM fields, its HF vision_config)."""
    vision = model.vision_config
    text = dict(
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        vocab_size=model.vocab_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        intermediate_size=model.ffn_hidden_size,
        head_dim=model.kv_channels,
    )
    if getattr(model, "num_moe_experts", None):
        text.update(
            num_experts=model.num_moe_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size,
        )
    return shapes_from_hf_config(
        {"model_type": vision.model_type, "text_config": text, "vision_config": vision.to_dict()}
    )


def vision_family(model: Any) -> Family:
    """The family record of a Megatron-Bridge Qwen-VL provider, from its HF vision config's class."""
    name = type(model.vision_config).__name__
    family = family_of_vision_config(name)
    if family is None:
        raise ValueError(f"vision config {name} belongs to no qvl family; families: {', '.join(FAMILIES)}")
    return family


def vision_is_megatron(model: Any) -> bool:
    """Qwen3-VL's vision tower is Megatron's (TP-sharded, recomputable); Qwen2/2.5-VL's is HF's, replicated."""
    return vision_family(model).megatron_vision_tower


def vision_param_count(model: Any) -> int:
    """Parameters of the vision tower incl. mergers, counted on the HF module built on the meta device."""
    import importlib

    import torch

    family = vision_family(model)
    module = importlib.import_module(f"transformers.models.{family.hf_module}.modeling_{family.hf_module}")
    with torch.device("meta"):
        tower = getattr(module, family.vision_tower_class)._from_config(model.vision_config)
    return sum(p.numel() for p in tower.parameters())


def padded_vocab(model: Any) -> int:
    if not getattr(model, "should_pad_vocab", False):
        return model.vocab_size
    step = model.make_vocab_size_divisible_by * model.tensor_model_parallel_size
    return math.ceil(model.vocab_size / step) * step


def lm_layer_params(model: Any) -> tuple[int, int]:
    """(dense, expert) parameters of one LM decoder layer, as Megatron-Core builds it."""
    h, heads, groups = model.hidden_size, model.num_attention_heads, model.num_query_groups
    d = model.kv_channels or h // heads
    q, kv = heads * d, groups * d
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if model.add_qkv_bias else 0) + 2 * h  # + 2 norms
    attention += 2 * d if getattr(model, "qk_layernorm", False) else 0
    gate = 2 if model.gated_linear_unit else 1
    experts = getattr(model, "num_moe_experts", None)
    if experts:
        f = model.moe_ffn_hidden_size
        return attention + h * experts, experts * (h * f * gate + f * h)  # router; experts
    f = model.ffn_hidden_size
    return attention + h * f * gate + f * h, 0


def lm_param_counts(model: Any) -> dict[str, int]:
    """LM parameters by part: embedding, output layer (0 when tied), final norm, decoder dense, experts."""
    vocab = padded_vocab(model)
    dense, expert = lm_layer_params(model)
    tied = model.share_embeddings_and_output_weights
    return dict(
        embedding=vocab * model.hidden_size,
        output=0 if tied else vocab * model.hidden_size,
        final_norm=model.hidden_size,
        dense=dense * model.num_layers,
        experts=expert * model.num_layers,
    )


def lora_params_per_layer(model: Any, rank: int) -> int:
    """LoRA adapter parameters one LM layer gets with Megatron-Bridge's default targets (qkv, proj, fc1, fc2)."""
    h, d = model.hidden_size, model.kv_channels or model.hidden_size // model.num_attention_heads
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    experts = getattr(model, "num_moe_experts", None) or 1
    f = model.moe_ffn_hidden_size if getattr(model, "num_moe_experts", None) else model.ffn_hidden_size
    gate = 2 if model.gated_linear_unit else 1
    return rank * ((h + q + 2 * kv) + (q + h) + experts * ((h + gate * f) + (f + h)))
