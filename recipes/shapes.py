"""What a Megatron-Bridge Qwen-VL provider holds, counted without building it: its cost-model shapes
(`qvl.foundation.cost`), its family, and its language-model and vision-tower parameters (the planner's and the
training benchmark's counts; `tests/recipes/test_planner.py` checks them against built models)."""

from __future__ import annotations

import functools
import importlib
import json
import math
from dataclasses import dataclass
from typing import Any

from qvl.foundation.cost import LMShape, VisionShape, shapes_from_hf_config
from qvl.foundation.families import FAMILIES, Family, family_of_vision_config
from qvl.foundation.megatron import gated_delta_net


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
            shared_expert_intermediate_size=getattr(model, "moe_shared_expert_intermediate_size", None) or 0,
        )
    delta = gated_delta_layers(model)
    if delta:  # Qwen3.5's hybrid LM: which layers are linear attention and how wide (their order does not matter)
        text.update(
            layer_types=["linear_attention"] * delta + ["full_attention"] * (model.num_layers - delta),
            linear_num_key_heads=model.linear_num_key_heads,
            linear_key_head_dim=model.linear_key_head_dim,
            linear_num_value_heads=model.linear_num_value_heads,
            linear_value_head_dim=model.linear_value_head_dim,
            linear_conv_kernel_dim=model.linear_conv_kernel_dim,
        )
    text.update(
        attention_output_gate=bool(getattr(model, "attention_output_gate", False)),
        mtp_num_hidden_layers=mtp_layers(model),  # the MTP layers this run trains (0 with mtp=false)
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
    return _meta_tower(model).params


@dataclass(frozen=True, kw_only=True)
class _TowerShapes:
    """What the planner reads of an HF vision tower built on the meta device."""

    params: int
    linears: tuple[tuple[str, int, int], ...]  # (module name, in_features, out_features) of every nn.Linear


def _meta_tower(model: Any) -> _TowerShapes:
    """The HF vision tower of `model`'s vision config, built on the meta device once per distinct config (a plan asks
    two or three times; the 100 registered recipes have a handful of towers): building one takes ~50 ms."""
    family, config = vision_family(model), model.vision_config
    kind = (type(config).__module__, type(config).__qualname__)
    return _tower_shapes(family.hf_module, family.vision_tower_class, kind, config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=64)
def _tower_shapes(hf_module: str, tower_class: str, config_kind: tuple[str, str], config_json: str) -> _TowerShapes:
    import torch

    config_class = getattr(importlib.import_module(config_kind[0]), config_kind[1])
    config = config_class.from_dict(json.loads(config_json))
    module = importlib.import_module(f"transformers.models.{hf_module}.modeling_{hf_module}")
    with torch.device("meta"):
        tower = getattr(module, tower_class)._from_config(config)
    linears = tuple(
        (name, m.in_features, m.out_features) for name, m in tower.named_modules() if isinstance(m, torch.nn.Linear)
    )
    return _TowerShapes(params=sum(p.numel() for p in tower.parameters()), linears=linears)


def padded_vocab(model: Any) -> int:
    if not getattr(model, "should_pad_vocab", False):
        return model.vocab_size
    step = model.make_vocab_size_divisible_by * model.tensor_model_parallel_size
    return math.ceil(model.vocab_size / step) * step


def gated_delta_layers(model: Any) -> int:
    """How many LM layers are Gated DeltaNet (linear attention) layers: Qwen3.5's hybrid pattern, else 0."""
    if not gated_delta_net(model):
        return 0
    freq = model.linear_attention_freq
    if isinstance(freq, int):  # one full-attention layer every `freq` (Megatron-Core's get_linear_attention_pattern)
        return sum(1 for i in range(model.num_layers) if (i + 1) % freq)
    return sum(freq)


def _attention_params(model: Any) -> int:
    """One full-attention block with its input norm (an output gate doubles the query projection)."""
    h, heads, groups = model.hidden_size, model.num_attention_heads, model.num_query_groups
    d = model.kv_channels or h // heads
    q, kv = heads * d, groups * d
    gated_q = 2 * q if getattr(model, "attention_output_gate", False) else q
    params = h * (gated_q + 2 * kv) + q * h + (q + 2 * kv if model.add_qkv_bias else 0) + h
    return params + (2 * d if getattr(model, "qk_layernorm", False) else 0)


def gated_delta_params(model: Any) -> int:
    """One Gated DeltaNet block with its input norm, as Megatron-Core's GatedDeltaNet holds it: in_proj (q, k, v,
    gate z, beta, alpha), the depthwise conv over q/k/v, A_log and dt_bias per value head, out_norm, out_proj."""
    h, heads_v = model.hidden_size, model.linear_num_value_heads
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = heads_v * model.linear_value_head_dim
    conv = (2 * qk + v) * model.linear_conv_kernel_dim
    return h * (2 * qk + 2 * v + 2 * heads_v) + conv + 2 * heads_v + model.linear_value_head_dim + v * h + h


def _mlp_params(model: Any) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP with its pre-MLP norm (router and shared expert are dense)."""
    h, gate = model.hidden_size, 2 if model.gated_linear_unit else 1
    experts = getattr(model, "num_moe_experts", None)
    if not experts:
        f = model.ffn_hidden_size
        return h * f * gate + f * h + h, 0
    f = model.moe_ffn_hidden_size
    shared = getattr(model, "moe_shared_expert_intermediate_size", None) or 0
    shared_params = shared * h * (gate + 1) + (h if shared and getattr(model, "moe_shared_expert_gate", False) else 0)
    return h * experts + shared_params + h, experts * (h * f * gate + f * h)  # router, shared expert; experts


def lm_layer_params(model: Any) -> tuple[int, int]:
    """(dense, expert) parameters of one LM decoder layer, as Megatron-Core builds it; for a hybrid LM (Qwen3.5)
    the mean over its Gated DeltaNet and full-attention layers."""
    dense, expert = _mlp_params(model)
    delta = gated_delta_layers(model)
    if not delta:
        return _attention_params(model) + dense, expert
    mixers = delta * gated_delta_params(model) + (model.num_layers - delta) * _attention_params(model)
    return mixers / model.num_layers + dense, expert


def mtp_layers(model: Any) -> int:
    """How many multi-token-prediction layers the model trains (Qwen3.5's one; qvl.training.mtp), else 0."""
    return int(getattr(model, "mtp_num_layers", None) or 0)


def mtp_layer_params(model: Any) -> tuple[int, int]:
    """(dense, expert) parameters of one multi-token-prediction layer as Megatron-Core builds it: eh_proj (2h -> h),
    its three norms (enorm, hnorm, final), and one full-attention decoder layer with the model's MLP."""
    h = model.hidden_size
    dense, expert = _mlp_params(model)
    return 2 * h * h + 3 * h + _attention_params(model) + dense, expert


def lm_param_counts(model: Any) -> dict[str, int]:
    """LM parameters by part: embedding, output layer (0 when tied), final norm, decoder dense, experts, and the
    multi-token-prediction layers (dense and expert parameters; they share the embedding and output layer)."""
    vocab = padded_vocab(model)
    mlp_dense, expert = _mlp_params(model)
    delta = gated_delta_layers(model)
    mixers = delta * gated_delta_params(model) + (model.num_layers - delta) * _attention_params(model)
    tied = model.share_embeddings_and_output_weights
    return dict(
        embedding=vocab * model.hidden_size,
        output=0 if tied else vocab * model.hidden_size,
        final_norm=model.hidden_size,
        dense=mixers + mlp_dense * model.num_layers,
        experts=expert * model.num_layers,
        mtp=sum(mtp_layer_params(model)) * mtp_layers(model),
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class AdapterCounts:
    """Adapter parameters a PEFT config adds to a model, by where they live (what trains in a PEFT run)."""

    language: int  # attention / Gated DeltaNet, dense MLP and shared-expert linears of every LM layer
    experts: int  # the routed experts' linears (one adapter per expert, as Megatron-Core's SequentialMLP holds them)
    vision: int  # the vision tower's blocks
    merger: int  # the merger and Qwen3-VL's deepstack mergers

    @property
    def total(self) -> int:
        return self.language + self.experts + self.vision + self.merger


def adapter_counts(model: Any, peft: Any) -> AdapterCounts:
    """The adapters of Megatron-Bridge's LoRA / DoRA config `peft` (qvl.bridges.adapters: rank `dim`, `targets` by
    meaning) on `model`: rank x (in + out) per adapted linear, and DoRA's magnitude (out) (tests/recipes/test_planner.py
    checks them against built models)."""
    targets = set(getattr(peft, "targets", None) or ["language"])
    dora = any(kind.__name__ == "DoRA" for kind in type(peft).__mro__)  # Megatron-Bridge's DoRA or qvl's
    size = functools.partial(_adapter, peft.dim, dora)
    vision, merger = _vision_adapters(model, size)
    delta = gated_delta_layers(model)
    mixers = delta * _delta_adapters(model, size) + (model.num_layers - delta) * _attention_adapters(model, size)
    dense, experts = _mlp_adapters(model, size)
    return AdapterCounts(
        language=mixers + dense * model.num_layers if "language" in targets else 0,
        experts=experts * model.num_layers if "experts" in targets else 0,
        vision=vision if "vision" in targets else 0,
        merger=merger if "merger" in targets else 0,
    )


def _adapter(rank: int, dora: bool, in_features: int, out_features: int) -> int:
    return rank * (in_features + out_features) + (out_features if dora else 0)


def _attention_adapters(model: Any, size: Any) -> int:
    h, d = model.hidden_size, model.kv_channels or model.hidden_size // model.num_attention_heads
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    gated_q = 2 * q if getattr(model, "attention_output_gate", False) else q
    return size(h, gated_q + 2 * kv) + size(q, h)  # linear_qkv, linear_proj


def _delta_adapters(model: Any, size: Any) -> int:
    h, heads_v = model.hidden_size, model.linear_num_value_heads
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = heads_v * model.linear_value_head_dim
    return size(h, 2 * qk + 2 * v + 2 * heads_v) + size(v, h)  # in_proj (q, k, v, z, beta, alpha), out_proj


def _mlp_adapters(model: Any, size: Any) -> tuple[int, int]:
    """(dense: the MLP or the shared expert, routed experts) adapters of one layer."""
    h, gate = model.hidden_size, 2 if model.gated_linear_unit else 1
    experts = getattr(model, "num_moe_experts", None)
    if not experts:
        f = model.ffn_hidden_size
        return size(h, gate * f) + size(f, h), 0
    shared, f = getattr(model, "moe_shared_expert_intermediate_size", None) or 0, model.moe_ffn_hidden_size
    dense = size(h, gate * shared) + size(shared, h) if shared else 0
    return dense, experts * (size(h, gate * f) + size(f, h))


def _vision_adapters(model: Any, size: Any) -> tuple[int, int]:
    """(tower blocks, mergers): every linear of the HF tower built on meta, whose shapes the Megatron tower shares."""
    linears = _meta_tower(model).linears
    blocks = sum(size(i, o) for name, i, o in linears if name.startswith("blocks."))
    return blocks, sum(size(i, o) for name, i, o in linears if not name.startswith("blocks."))
