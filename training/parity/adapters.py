"""PEFT in the training-parity check: a qvl `*_peft` recipe against transformers + peft from the same adapters.

qvl's side trains the recipe as any other, except where its weights come from: the check loads the HF checkpoint's
weights itself and then applies the recipe's adapters (`adapter_hook`; Megatron-Bridge's own PEFT hook would first
load a pretrained Megatron checkpoint). Before step 1 its adapters are read in peft's layout
(qvl.bridges.adapter_export: B through the bridge's mapping of the weight it adapts, A the same for every HF module of a
fused projection). The reference is transformers' model wrapped by `peft` with the same rank, alpha and method, loaded
with those initial tensors, and with the A of a fused projection's HF modules tied into one parameter: qvl trains one
A for q/k/v (gate/up; Qwen3.5's in_proj_qkv/z/b/a), so three independent A's would be another model from step 2 on.
MoE expert adapters are peft's LoRA on transformers' fused 3-D expert parameters (qvl.bridges.adapter_experts).
Step 1's gradients and the final weights are compared on the adapters alone, under peft's names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qvl.foundation.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AdapterRecord:
    """qvl's adapters as the reference must start from them."""

    rank: int
    alpha: int
    dora: bool
    modules: list[str]  # the HF modules adapted (live names)
    parameters: list[str] = field(default_factory=list)  # the fused 3-D expert parameters adapted (live names)
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # before step 1, under peft's names
    shared_a: list[list[str]] = field(default_factory=list)  # lora_A names that are one qvl parameter


def take_adapters(config: Any, options: dict[str, Any]) -> Any | None:
    """The recipe's adapters, taken out of the config so Megatron-Bridge's PEFT hook (which loads a pretrained
    Megatron checkpoint) does not run; None for a recipe without. Refuses what the comparison cannot read."""
    adapters, config.peft = config.peft, None
    if adapters is None:
        return None
    layout = {k: int(options.get(k, 1)) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")}
    if any(size > 1 for size in layout.values()):
        raise ConfigError(
            f"verifying a PEFT recipe runs on one process (got {layout}); the adapters are read in peft's layout "
            "from a single-rank model: drop the parallel options"
        )
    if adapters.dropout:
        raise ConfigError(
            f"adapter_dropout={adapters.dropout}: the two frameworks draw different dropout masks; verify with "
            "adapter_dropout=0"
        )
    return adapters


def adapter_hook(adapters: Any) -> Callable[[list], list]:
    """Pre-wrap hook: the adapters applied to the model chunks (after the HF weights are loaded)."""

    def apply(chunks: list) -> list:
        chunks = adapters(chunks, training=True)
        adapters.set_params_to_save(chunks)
        return chunks

    return apply


def reference_model(model: Any, record: AdapterRecord) -> Any:
    """transformers' `model` wrapped by peft with qvl's adapters: the same config, initial tensors and shared A's."""
    from peft import get_peft_model

    return load_adapters(get_peft_model(model, lora_config_of(record)), record)


def lora_config_of(record: AdapterRecord) -> Any:
    """peft's LoraConfig for qvl's adapters: the same method, rank, alpha, modules and expert parameters."""
    from qvl.bridges.adapter_export import lora_config

    return lora_config(
        rank=record.rank,
        alpha=record.alpha,
        dropout=0.0,
        dora=record.dora,
        modules=record.modules,
        parameters=record.parameters,
    )


def load_adapters(peft_model: Any, record: AdapterRecord) -> Any:
    """A peft model (wrapped with `lora_config_of(record)`) started from qvl's initial adapters, the A of each fused
    projection's HF modules tied into one parameter."""
    from peft import set_peft_model_state_dict

    loaded = set_peft_model_state_dict(peft_model, record.initial)
    if loaded.unexpected_keys:
        raise ConfigError(f"qvl's adapters have no place in peft's model: {loaded.unexpected_keys[:3]}")
    for names in record.shared_a:
        first = _lora_a(peft_model, names[0])
        for name in names[1:]:
            _lora_a_owner(peft_model, name).weight = first
    return peft_model


def _lora_a_owner(peft_model: Any, name: str) -> torch.nn.Linear:
    module = peft_model.get_submodule(name.removesuffix(".lora_A.weight"))
    return module.lora_A["default"]


def _lora_a(peft_model: Any, name: str) -> torch.nn.Parameter:
    return _lora_a_owner(peft_model, name).weight


def adapter_names(tensors: dict[str, torch.Tensor], record: AdapterRecord) -> dict[str, torch.Tensor]:
    """The reference's adapter tensors (PeftModel parameter names) under peft's state-dict names, every shared A
    under each of its names, as qvl's side records them."""
    out = {}
    for name, tensor in tensors.items():
        if ".lora_" not in name:
            continue
        key = name.replace(".default.weight", ".weight").replace(
            ".lora_magnitude_vector.weight", ".lora_magnitude_vector"
        )
        out[key] = tensor.float()
    for names in record.shared_a:
        present = next((n for n in names if n in out), None)
        for name in names if present else ():
            out[name] = out[present]
    return out


def adapter_notes(record: AdapterRecord | None) -> list[str]:
    """What the PEFT comparison did on purpose."""
    if record is None:
        return []
    method = "DoRA" if record.dora else "LoRA"
    experts = (
        f" and {len(record.parameters)} fused expert parameters (every expert's pair)" if record.parameters else ""
    )
    return [
        f"adapters: {method} rank {record.rank}, alpha {record.alpha} on {len(record.modules)} HF modules{experts}; the "
        "reference (transformers + peft) started from qvl's initial adapters (A drawn per module, B zero), and "
        f"the A of each fused projection's HF modules ({len(record.shared_a)} groups, e.g. q/k/v) was tied into one "
        "parameter, as qvl trains one A for the fused Megatron linear; gradients and weights compared on the "
        "adapters alone."
    ]
