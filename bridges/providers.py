"""Megatron-Bridge model providers for Qwen-VL checkpoints, with qvl's fixes applied.

`provider_from_hf(config_or_path)` is the one place a provider is made: it goes through
Megatron-Bridge's AutoBridge (and qvl's own bridge registrations, e.g. Qwen2-VL), then corrects the
fields the upstream bridges leave at defaults instead of reading them from the checkpoint's config.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from qvl.foundation.families import family_of_provider, family_of_vision_config
from qvl.foundation.layout import ModelFacts
from qvl.foundation.megatron import import_megatron_bridge

logger = logging.getLogger(__name__)


def auto_bridge(config_or_path: Any):
    """A Megatron-Bridge AutoBridge for an HF config object, or an HF directory / hub id (config only)."""
    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)

    if isinstance(config_or_path, (str, Path)):
        from transformers import AutoConfig

        config_or_path = AutoConfig.from_pretrained(str(config_or_path), trust_remote_code=False)
    return AutoBridge.from_hf_config(config_or_path)


def provider_from_hf(config_or_path: Any):
    """A Megatron-Bridge provider (no weights loaded) for an HF Qwen-VL config or checkpoint directory."""
    bridge = auto_bridge(config_or_path)
    provider = bridge.to_megatron_provider(load_weights=False)
    apply_provider_fixes(
        provider, bridge.hf_pretrained.config if hasattr(bridge.hf_pretrained, "config") else bridge.hf_pretrained
    )
    return provider


def provider_as(cls: type, provider: Any) -> Any:
    """The same provider settings (its dataclass init fields), as an instance of `cls`, a qvl subclass of its class:
    how qvl's bridges hand out their own provider for what an upstream bridge's `provider_bridge` read."""
    values = {f.name: getattr(provider, f.name) for f in dataclasses.fields(provider) if f.init}
    return cls(**values)


def freeze_as_configured(model: Any, provider: Any) -> Any:
    """`model` with the parts its provider's `freeze_*` fields name frozen, as Megatron-Bridge's VLM providers do
    in `provide`; returns it."""
    if provider.freeze_language_model or provider.freeze_vision_model or provider.freeze_vision_projection:
        model.freeze(
            freeze_language_model=provider.freeze_language_model,
            freeze_vision_model=provider.freeze_vision_model,
            freeze_vision_projection=provider.freeze_vision_projection,
        )
    return model


def apply_provider_fixes(provider: Any, hf_config: Any) -> None:
    """Copy into the provider what the upstream bridges do not read from the HF config; give a replicated HF
    vision tower the packed varlen attention (one kernel call per pack on a GPU, qvl.kernels.varlen_attention) and the
    lean tower's fused kernels (qvl.kernels.speed_hf_vision); accumulate weight gradients into main_grad in the GEMM
    (qvl.kernels.torch_wgrad_accum)."""
    from qvl.bridges.fixes import fix_provider
    from qvl.kernels.speed_hf_vision import use_lean_vision
    from qvl.kernels.torch_wgrad_accum import use_fused_wgrad_accumulation
    from qvl.kernels.varlen_attention import use_varlen_vision_attention

    fix_provider(provider, hf_config)
    use_varlen_vision_attention(provider)
    use_lean_vision(provider)  # fused norm and rotary, precomputed inputs (qvl.kernels.speed_hf_vision)
    use_fused_wgrad_accumulation(provider)  # after fix_provider: the no-TE settings turn it off


@dataclasses.dataclass(kw_only=True, frozen=True)
class RecomputeVisionTowers:
    """Pre-wrap hook: every replicated HF vision tower (Qwen2-VL / Qwen2.5-VL) recomputes its first `blocks` blocks
    (None: all) in backward, keeping only each such block's input (transformers' gradient checkpointing,
    non-reentrant: the tower has no dropout, so the recomputed forward equals the first without the RNG state saved
    and restored around it, and a CUDA graph capture of the tower, qvl.kernels.tower_graphs, need not read the CUDA
    generator's state, which torch refuses in part while capturing). The first blocks, as Megatron-Core's
    `recompute_method="block"` takes its first layers: backward reaches them last, after every later block has freed
    what it kept, so their reruns add nothing to the peak."""

    blocks: int | None = None

    def __call__(self, model: list[Any]) -> list[Any]:
        from transformers import PreTrainedModel

        towers, recomputed = 0, 0
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, PreTrainedModel) and family_of_vision_config(type(module.config).__name__):
                    module.gradient_checkpointing_enable(
                        gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False}
                    )
                    for index, block in enumerate(module.blocks):
                        block.gradient_checkpointing = self.blocks is None or index < self.blocks
                        recomputed += block.gradient_checkpointing
                    towers += 1
        logger.info("vision recompute on in %d HF vision tower(s), %d blocks in all", towers, recomputed)
        return model


def layout_facts(provider: Any, name: str = "the model") -> ModelFacts:
    """What a parallel layout must divide in `provider`: LM heads, KV heads, layers, experts, and the vision
    heads where the vision tower is Megatron's (TP-split); an HF vision tower is replicated over TP."""
    family = family_of_provider(provider)
    split_vision = family is not None and family.megatron_vision_tower
    return ModelFacts(
        attention_heads=provider.num_attention_heads,
        kv_heads=provider.num_query_groups or provider.num_attention_heads,
        layers=provider.num_layers,
        experts=getattr(provider, "num_moe_experts", None) or None,
        vision_heads=provider.vision_config.num_heads if split_vision else None,
        name=name,
    )
