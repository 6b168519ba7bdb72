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
- the patch mergers use exact GELU as HF does (upstream uses the blocks' tanh approximation);
- the model's forward, its vision tower's forward and its decoder's deepstack addition also take the host facts
  of a micro-batch from qvl's step (the vision rows as indices, the images' and videos' token order, the tower's
  precomputed inputs, each distinct image encoded once) and, given them, run without reading the device back
  (qvl.kernels.speed_qwen3_vl_sync_free, qvl.kernels.speed_qwen3_vl_tower); without them they are upstream's, the
  pixels of a micro-batch given each distinct image once (`vision_sources`) expanded back for it.
Mapping tables: inherited unchanged from Megatron-Bridge's Qwen3VLBridge / Qwen3VLMoEBridge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

import torch
import torch.nn.functional as F
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.qwen_vl import qwen3_vl_bridge as upstream_bridge
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as upstream_model
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import transformer_block as upstream_block
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import vision_model as upstream_vision
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger
from megatron.bridge.models.qwen_vl.qwen3_vl_provider import Qwen3VLModelProvider, Qwen3VLMoEModelProvider
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

from qvl.bridges.fixes import mrope_section
from qvl.bridges.providers import freeze_as_configured, provider_as
from qvl.foundation import megatron, patches
from qvl.foundation.megatron import have_transformer_engine
from qvl.kernels import speed_qwen3_vl_sync_free, speed_qwen3_vl_tower, torch_qwen3_vl_vision, torch_wgrad_accum
from qvl.kernels.local_specs import local_gpt_layer_spec
from qvl.kernels.speed_sync_free import HostBatch
from qvl.kernels.tower_inputs import MegatronTowerInputs, VisionSources
from qvl.kernels.vision_placement import TakesVisionPlacement


class Qwen3VLVisionModel(upstream_vision.Qwen3VLVisionModel):
    """Megatron-Bridge's Qwen3-VL vision tower whose forward also takes the loader's precomputed inputs."""

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        grid_thw: torch.Tensor,
        inference_params=None,
        extra_block_kwargs: dict | None = None,
        tower_inputs: MegatronTowerInputs | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Upstream's forward; given `tower_inputs` (the host-computed inputs of `grid_thw`), the same result without
        reading the grid back (qvl.kernels.speed_qwen3_vl_tower.prepared_tower_forward)."""
        if not speed_qwen3_vl_tower.takes_prepared_inputs(self, tower_inputs, inference_params):
            return super().forward(hidden_states, grid_thw, inference_params, extra_block_kwargs)
        return speed_qwen3_vl_tower.prepared_tower_forward(self, hidden_states, tower_inputs, extra_block_kwargs)


class Qwen3VLTransformerBlock(upstream_block.Qwen3VLTransformerBlock):
    """Megatron-Bridge's Qwen3-VL language decoder, which also adds the deepstack features at int64 row indices."""

    def _deepstack_process(
        self, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Upstream's sum at the visual tokens' rows, out of place (the hidden states may be a CUDA-graphed layer's
        output, which autograd forbids writing in place: qvl.kernels.speed_qwen3_vl_sync_free.add_deepstack_at). qvl's
        forward passes int64 [b*s] row indices, read nothing back; a boolean mask (each rank's share under sequence
        parallelism) gives its rows as upstream's boolean index reads them."""
        if visual_pos_masks.dtype == torch.bool:
            visual_pos_masks = visual_pos_masks.reshape(-1).nonzero().squeeze(1)
        return speed_qwen3_vl_sync_free.add_deepstack_at(hidden_states, visual_pos_masks, visual_embeds)


def _adopt(module: torch.nn.Module | None, cls: type) -> None:
    """Give a module upstream's `__init__` built its qvl subclass `cls`, which adds methods and no state.

    `Qwen3VLModel.__init__` builds its tower and `Qwen3VLGPTModel.__init__` its decoder by their upstream class names;
    building qvl's instead would build each twice (drawing from the RNG again, so other initial weights) or replace
    those names in upstream's modules."""
    if module is not None:
        module.__class__ = cls


class Qwen3VLModel(upstream_model.Qwen3VLModel, TakesVisionPlacement):
    """Megatron-Bridge's Qwen3-VL model, with a local-module vision tower where TE is absent, whose forward also takes
    the host facts of a micro-batch from qvl's step."""

    def __init__(self, *args, **kwargs):
        with contextlib.nullcontext() if have_transformer_engine() else patches.applied(torch_qwen3_vl_vision.GROUP):
            super().__init__(*args, **kwargs)
        # Megatron-Bridge 0.6.2's patch mergers (final and deepstack) reuse the vision blocks'
        # activation, tanh-approximated GELU ("gelu_pytorch_tanh"), but HF's Qwen3VLVisionPatchMerger uses
        # exact nn.GELU(). That mismatch was the ~1e-5 logit residual against HF; exact GELU removes it.
        for module in self.modules():
            if isinstance(module, Qwen3VLVisionPatchMerger):
                module.activation_func = F.gelu
        _adopt(self.vision_model, Qwen3VLVisionModel)
        _adopt(getattr(self.language_model, "decoder", None), Qwen3VLTransformerBlock)
        vision = getattr(self, "vision_model", None)
        if vision is not None and not have_transformer_engine():
            torch_wgrad_accum.megatron_tower_linears_into_main_grad(vision, self.config)  # as the LM's linears
            if megatron.jit_fusions_usable():
                speed_qwen3_vl_tower.fuse_bias_ops(vision)  # its bias-GELU and bias-dropout-add fused, as the LM's

    def _expose_language_model_for_cuda_graph_helper(self) -> None:
        """Upstream registers the language model's decoder again on the root where the language model asks for CUDA
        graphs, for Transformer Engine's graph helper: its parameters then appear twice in the sharded state dict (a
        root `decoder.*` beside `language_model.decoder.*`), and loading a converted checkpoint into a graphed run
        failed on them (seen with the CPU's recorded graphs). qvl's graphs are Megatron-Core's local ones, which
        need none of it (qvl.kernels.speed_cuda_graphs)."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        inference_params=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        image_input_mask: torch.Tensor | None = None,
        video_input_mask: torch.Tensor | None = None,
        cp_img_num: list[int] | None = None,
        images_padded: list[bool] | None = None,
        inference_context=None,
        runtime_gather_output: bool | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        host_batch: HostBatch | None = None,
        vision_sources: VisionSources | None = None,
        **kwargs,
    ):
        """Upstream's forward; for a packed micro-batch on one CP rank whose `host_batch` holds its vision placement,
        the same result with the vision rows addressed by index (qvl.kernels.speed_qwen3_vl_sync_free).
        `vision_sources`: the pixels hold each distinct image once (qvl.training.step.model_inputs)."""
        placement = None if host_batch is None else host_batch.vision_placement
        indexed = placement is not None and speed_qwen3_vl_sync_free.takes_indexed_path(
            self,
            input_ids=input_ids,
            position_ids=position_ids,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
            image_input_mask=image_input_mask,
            video_input_mask=video_input_mask,
        )
        if not indexed:
            if vision_sources is not None:
                pixel_values, pixel_values_videos = vision_sources.expanded(pixel_values, pixel_values_videos)
            return super().forward(
                input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                labels=labels,
                loss_mask=loss_mask,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
                extra_block_kwargs=extra_block_kwargs,
                pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                image_input_mask=image_input_mask,
                video_input_mask=video_input_mask,
                cp_img_num=cp_img_num,
                images_padded=images_padded,
                inference_context=inference_context,
                runtime_gather_output=runtime_gather_output,
                mm_token_type_ids=mm_token_type_ids,
                **kwargs,
            )
        return speed_qwen3_vl_sync_free.indexed_forward(
            self,
            placement,
            input_ids=input_ids,
            position_ids=position_ids,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            image_tower_inputs=host_batch.image_tower_inputs,
            video_tower_inputs=host_batch.video_tower_inputs,
            runtime_gather_output=runtime_gather_output,
            **kwargs,
        )


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
    return freeze_as_configured(model, provider)


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


@MegatronModelBridge.register_bridge(
    source=Qwen3VLForConditionalGeneration, target=Qwen3VLModel, provider=QvlQwen3VLModelProvider, model_type="qwen3_vl"
)
class Qwen3VLBridge(upstream_bridge.Qwen3VLBridge):
    """Megatron-Bridge's Qwen3-VL bridge, handing out qvl's provider; mappings inherited."""

    def provider_bridge(self, hf_pretrained) -> QvlQwen3VLModelProvider:
        provider = provider_as(QvlQwen3VLModelProvider, super().provider_bridge(hf_pretrained))
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
        provider = provider_as(QvlQwen3VLMoEModelProvider, super().provider_bridge(hf_pretrained))
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
