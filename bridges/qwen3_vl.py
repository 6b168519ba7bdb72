"""Qwen3-VL (dense and MoE) <-> Megatron-Core without requiring Transformer Engine.

Megatron-Bridge 0.6.2's Qwen3-VL path is TE-only: `Qwen3VLModelProvider.provide` (and the MoE one)
always builds the language layers with `get_gpt_layer_with_transformer_engine_spec`, and
`Qwen3VLModel.__init__` always builds the vision tower from `get_vit_layer_with_transformer_engine_spec`
with TENorm / TEColumnParallelLinear / TERowParallelLinear in the patch merger. Its weight mapping
tables and forward pass are right, so qvl keeps them and changes only module construction:
- the providers below choose TE specs where TE is installed and Megatron-Core's local modules (with
  qvl's SDPA attention, which handles the vision tower's packed per-image sequences) where it is not;
- the bridges below are Megatron-Bridge's, re-registered for the same HF classes so AutoBridge hands
  out these providers;
- the patch mergers use exact GELU as HF does (upstream uses the blocks' tanh approximation).
Mapping tables: inherited unchanged from Megatron-Bridge's Qwen3VLBridge / Qwen3VLMoEBridge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

import torch.nn.functional as F
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.qwen_vl import qwen3_vl_bridge as upstream_bridge
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as upstream_model
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger
from megatron.bridge.models.qwen_vl.qwen3_vl_provider import Qwen3VLModelProvider, Qwen3VLMoEModelProvider
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

from qvl.bridges.fixes import mrope_section
from qvl.foundation import patches
from qvl.foundation.megatron import have_transformer_engine
from qvl.kernels import torch_qwen3_vl_vision
from qvl.kernels.local_specs import local_gpt_layer_spec


class Qwen3VLModel(upstream_model.Qwen3VLModel):
    """Megatron-Bridge's Qwen3-VL model, with a local-module vision tower where TE is absent."""

    def __init__(self, *args, **kwargs):
        with contextlib.nullcontext() if have_transformer_engine() else patches.applied(torch_qwen3_vl_vision.GROUP):
            super().__init__(*args, **kwargs)
        # Megatron-Bridge 0.6.2's patch mergers (final and deepstack) reuse the vision blocks'
        # activation, tanh-approximated GELU ("gelu_pytorch_tanh"), but HF's Qwen3VLVisionPatchMerger uses
        # exact nn.GELU(). That mismatch was the ~1e-5 logit residual against HF; exact GELU removes it.
        for module in self.modules():
            if isinstance(module, Qwen3VLVisionPatchMerger):
                module.activation_func = F.gelu


def _provide(provider, pre_process, post_process, vp_stage, *, num_experts: int | None):
    """Shared body of both providers' `provide`: the model with TE or local language specs."""
    if have_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=provider.qk_layernorm, fp8=False
        )
    else:
        spec = local_gpt_layer_spec(provider, vp_stage=vp_stage)
    model = Qwen3VLModel(
        language_transformer_config=provider,
        language_transformer_layer_spec=spec,
        vision_transformer_config=provider.vision_config,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=provider._pg_collection,
        add_encoder=provider.add_encoder,
        add_decoder=provider.add_decoder,
    )
    if provider.freeze_language_model or provider.freeze_vision_model or provider.freeze_vision_projection:
        model.freeze(
            freeze_language_model=provider.freeze_language_model,
            freeze_vision_model=provider.freeze_vision_model,
            freeze_vision_projection=provider.freeze_vision_projection,
        )
    return model


@dataclasses.dataclass
class QvlQwen3VLModelProvider(Qwen3VLModelProvider):
    """Qwen3-VL dense provider that builds with or without Transformer Engine."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Qwen3VLModel:
        return _provide(self, pre_process, post_process, vp_stage, num_experts=None)


@dataclasses.dataclass
class QvlQwen3VLMoEModelProvider(Qwen3VLMoEModelProvider):
    """Qwen3-VL MoE provider that builds with or without Transformer Engine."""

    def finalize(self) -> None:
        # Upstream forces sequence parallelism for TP > 1; without TE there is no SP-capable norm.
        sequence_parallel = self.sequence_parallel
        super().finalize()
        if not have_transformer_engine():
            self.sequence_parallel = sequence_parallel

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Qwen3VLModel:
        return _provide(self, pre_process, post_process, vp_stage, num_experts=self.num_moe_experts)


def _as(cls, provider):
    """The same provider settings, as an instance of the qvl subclass `cls`."""
    values = {f.name: getattr(provider, f.name) for f in dataclasses.fields(provider) if f.init}
    return cls(**values)


@MegatronModelBridge.register_bridge(
    source=Qwen3VLForConditionalGeneration, target=Qwen3VLModel, provider=QvlQwen3VLModelProvider, model_type="qwen3_vl"
)
class Qwen3VLBridge(upstream_bridge.Qwen3VLBridge):
    """Megatron-Bridge's Qwen3-VL bridge, handing out qvl's provider; mappings inherited."""

    def provider_bridge(self, hf_pretrained) -> QvlQwen3VLModelProvider:
        provider = _as(QvlQwen3VLModelProvider, super().provider_bridge(hf_pretrained))
        provider.mrope_section = mrope_section(hf_pretrained.config.text_config)  # no [24, 20, 20] fallback
        return provider


@MegatronModelBridge.register_bridge(
    source=Qwen3VLMoeForConditionalGeneration,
    target=Qwen3VLModel,
    provider=QvlQwen3VLMoEModelProvider,
    model_type="qwen3_vl_moe",
)
class Qwen3VLMoEBridge(upstream_bridge.Qwen3VLMoEBridge):
    """Megatron-Bridge's Qwen3-VL MoE bridge, handing out qvl's provider; mappings inherited.

    Upstream picks fused (`experts.gate_up_proj`) or per-expert HF names from the checkpoint's keys and
    falls back to per-expert when there is no checkpoint (a config-only bridge, as in export). But
    transformers 5.x's Qwen3VLMoe loads only the fused layout and silently re-initialises experts
    given per-expert names. Without a checkpoint, qvl takes the layout from the installed
    transformers model class itself.
    """

    def provider_bridge(self, hf_pretrained) -> QvlQwen3VLMoEModelProvider:
        provider = _as(QvlQwen3VLMoEModelProvider, super().provider_bridge(hf_pretrained))
        provider.mrope_section = mrope_section(hf_pretrained.config.text_config)
        return provider

    def mapping_registry(self):
        hf_pretrained = getattr(self, "hf_pretrained", None)
        if getattr(getattr(hf_pretrained, "state", None), "source", None) is not None:
            return super().mapping_registry()
        self.hf_pretrained = _KeysOnlyCheckpoint(hf_pretrained, _transformers_state_keys(hf_pretrained))
        try:
            return super().mapping_registry()
        finally:
            self.hf_pretrained = hf_pretrained


def _transformers_state_keys(hf_pretrained) -> list[str]:
    """The parameter names the installed transformers class uses for this config (built on meta)."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = getattr(hf_pretrained, "config", hf_pretrained)
    with torch.device("meta"):
        return list(AutoModelForImageTextToText.from_config(config).state_dict())


class _KeysOnlyCheckpoint:
    """Looks like a loaded checkpoint to `moe_experts_stored_packed`: `.state.source.get_all_keys()`."""

    def __init__(self, wrapped, keys: list[str]):
        self._wrapped = wrapped
        self.state = types.SimpleNamespace(source=types.SimpleNamespace(get_all_keys=lambda: keys))

    def __getattr__(self, name):
        return getattr(self._wrapped, name)
