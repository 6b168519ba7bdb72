"""MoE expert adapters in `peft`'s format (qvl.bridges.adapter_export writes them beside the other adapters).

transformers 5 keeps a layer's experts as fused 3-D parameters (`experts.gate_up_proj` [E, 2I, H] holding each
expert's gate rows then up rows, `experts.down_proj` [E, H, I]), which `peft` adapts through `target_parameters`
(its `ParamWrapper`): one LoRA pair per parameter holding every expert's factors, lora_A [E*r, in] with expert-major
rows and lora_B [out, r*E] with rank-major columns, so expert e's update is sum_i B[:, i*E + e] A[e*r + i] (peft's
`ParamWrapper.get_delta_weight`). In qvl's Megatron model every expert carries its own pair: linear_fc1 (gate and up
rows, which Megatron-Bridge's mapping splits into the checkpoint's per-expert gate_proj / up_proj for Qwen3.5-MoE, or
writes as the expert's slice of the fused tensor for Qwen3-VL-MoE) and linear_fc2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from qvl.foundation.errors import ConversionError

# A per-expert tensor of an HF checkpoint (Qwen3.5-MoE's), as Megatron-Bridge's mappings name it.
_EXPERT_TENSOR = re.compile(r"\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# Where each per-expert projection's rows go in its fused parameter (gate before up: transformers chunks them so).
_ROW_BLOCK = {"gate_proj": 0, "up_proj": 1, "down_proj": 0}
# A Megatron expert linear (SequentialMLP's local_experts.N; EP=1 at export, so N is the expert's index).
_MEGATRON_EXPERT = re.compile(r"\.experts\.local_experts\.(?P<expert>\d+)\.")


def expert_place(hf_name: str, weight_name: str) -> tuple[int, int]:
    """(expert index, row block) of the adapter B rows a mapping wrote under `hf_name` for the Megatron expert
    weight `weight_name`: from a per-expert checkpoint name (Qwen3.5-MoE), else from the Megatron name with the
    mapping writing the expert's whole slice of the fused parameter (Qwen3-VL-MoE)."""
    if match := _EXPERT_TENSOR.search(hf_name):
        return int(match["expert"]), _ROW_BLOCK[match["proj"]]
    if match := _MEGATRON_EXPERT.search(weight_name):
        return int(match["expert"]), 0
    raise ConversionError(f"{weight_name} maps to {hf_name}, whose expert index qvl cannot tell")


def is_expert_parameter(hf_model: Any, live_name: str) -> bool:
    """Whether `live_name` is a fused 3-D expert parameter of the (meta) transformers model."""
    try:
        return hf_model.get_parameter(live_name).ndim == 3
    except AttributeError:
        return False


@dataclass(kw_only=True, slots=True)
class FusedExpertFactors:
    """Every expert's LoRA factors of one fused HF expert parameter, gathered from the Megatron experts."""

    a: dict[int, torch.Tensor] = field(default_factory=dict)  # expert -> A [r, in]
    b: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # expert -> {row block: B rows [rows, r]}

    def add(self, place: tuple[int, int], lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        expert, block = place
        self.a[expert] = lora_a
        self.b.setdefault(expert, {})[block] = lora_b

    def stacked(self, parameter: str, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_A [E*r, in], lora_B [out, r*E]) in peft's ParamWrapper layout."""
        missing = sorted(set(range(num_experts)) - set(self.a))
        if missing:
            raise ConversionError(
                f"{parameter}: experts {missing[:8]} of {num_experts} carry no adapter; export with --merged"
            )
        a = torch.cat([self.a[e] for e in range(num_experts)], dim=0)
        rows = [
            torch.cat([blocks[k] for k in sorted(blocks)], dim=0) for blocks in (self.b[e] for e in range(num_experts))
        ]
        b = torch.stack(rows, dim=2).reshape(rows[0].shape[0], -1)
        return a.contiguous(), b.contiguous()


def wrapper_prefixes(hf_model: Any, config: Any) -> dict[str, str]:
    """{live parameter name: peft's state-dict prefix of the ParamWrapper adapting it} for `config` (a LoraConfig
    with target_parameters) on `hf_model` (built on meta; changed in place). Several parameters of one module nest
    their wrappers (`experts.base_layer...`), in an order peft decides; reading it off peft's own model keeps it so."""
    from peft import get_peft_model
    from peft.tuners.lora.layer import ParamWrapper

    prefixes = {}
    for name, module in get_peft_model(hf_model, config).named_modules():
        if isinstance(module, ParamWrapper):
            owner = re.sub(r"(\.base_layer)+$", "", name.removeprefix("base_model.model."))
            prefixes[f"{owner}.{module.parameter_name}"] = name
    return prefixes


def expert_tensors(factors: dict[str, FusedExpertFactors], hf_model: Any, config: Any) -> dict[str, torch.Tensor]:
    """The adapter file's tensors of every fused expert parameter in `factors` (keyed by its live name)."""
    shapes = {name: tuple(hf_model.get_parameter(name).shape) for name in factors}
    prefixes = wrapper_prefixes(hf_model, config)
    tensors = {}
    for parameter, entry in factors.items():
        if parameter not in prefixes:
            raise ConversionError(f"{parameter}: peft adapts no such expert parameter of HF_BASE's model")
        lora_a, lora_b = entry.stacked(parameter, shapes[parameter][0])
        tensors[f"{prefixes[parameter]}.lora_A.weight"] = lora_a
        tensors[f"{prefixes[parameter]}.lora_B.weight"] = lora_b
    return tensors
