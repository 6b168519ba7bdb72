"""Qwen2.5-VL <-> Megatron-Core: Megatron-Bridge's bridge, handing out qvl's provider and model class.

Megatron-Bridge 0.6.2's `Qwen25VLBridge` (megatron/bridge/models/qwen_vl/qwen25_vl_bridge.py) converts Qwen2.5-VL
right; qvl keeps its mapping table and its model, and changes one method: `Qwen25VLModel.forward` takes the host
facts of a micro-batch from qvl's loader (`host_batch`, qvl.kernels.speed_sync_free.HostBatch) and, given them,
runs without reading the device back (the loader's mRoPE positions, the vision features placed and checked on the
host, the tower given its precomputed inputs, each distinct image encoded once); given each distinct image's pixels
once (`vision_sources`, qvl.kernels.tower_inputs.VisionSources), upstream's forward gets them expanded back.
Qwen2-VL's model (qvl.bridges.qwen2_vl) inherits it. The provider fields upstream leaves at defaults are corrected by
qvl.bridges.fixes, as for every family.
"""

# ruff: noqa: E402  (Megatron-Bridge must be imported through import_megatron_bridge first, as in qwen3_vl.py)
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

import torch
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.qwen_vl import modeling_qwen25_vl as upstream_model
from megatron.bridge.models.qwen_vl import qwen25_vl_bridge as upstream_bridge
from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
from transformers import Qwen2_5_VLForConditionalGeneration

from qvl.bridges.providers import freeze_as_configured, provider_as
from qvl.kernels import speed_sync_free
from qvl.kernels.speed_sync_free import HostBatch
from qvl.kernels.tower_inputs import VisionSources


class Qwen25VLModel(upstream_model.Qwen25VLModel):
    """Megatron-Bridge's Qwen2.5-VL model whose forward also takes the loader's host facts of a micro-batch."""

    @property
    def square_merge_size(self) -> int:
        """Patches per vision feature row (the name Megatron-Bridge's Qwen3-VL model gives it)."""
        return self.config.vision_config.spatial_merge_size**2

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params=None,
        loss_mask: torch.Tensor | None = None,
        host_batch: HostBatch | None = None,
        vision_sources: VisionSources | None = None,
        output_processor: Callable[..., Any] | None = None,
        output_processor_context: Any = None,
    ) -> torch.Tensor:
        """Upstream's forward; for a packed micro-batch of qvl's loader with its `host_batch`, the same result
        without host reads (qvl.kernels.speed_sync_free.loader_positions_forward). `vision_sources`: the pixels hold
        each distinct image once (qvl.training.step.model_inputs). `output_processor` and its context go to the language
        model's `_postprocess` on that path (upstream's forward runs its own postprocess: the losses at every
        position)."""
        if not speed_sync_free.takes_loader_positions(
            host_batch, input_ids=input_ids, position_ids=position_ids, packed_seq_params=packed_seq_params
        ):
            if vision_sources is not None:
                pixel_values, pixel_values_videos = vision_sources.expanded(pixel_values, pixel_values_videos)
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                second_per_grid_ts=second_per_grid_ts,
                mm_token_type_ids=mm_token_type_ids,
                labels=labels,
                inference_context=inference_context,
                packed_seq_params=packed_seq_params,
                extra_block_kwargs=extra_block_kwargs,
                runtime_gather_output=runtime_gather_output,
                inference_params=inference_params,
                loss_mask=loss_mask,
            )
        return speed_sync_free.loader_positions_forward(
            self,
            host_batch,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            labels=labels,
            loss_mask=loss_mask,
            runtime_gather_output=runtime_gather_output,
            packed_seq_params=packed_seq_params,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )


@dataclasses.dataclass
class QvlQwen25VLModelProvider(Qwen25VLModelProvider):
    """Megatron-Bridge's Qwen2.5-VL provider, building qvl's `Qwen25VLModel`."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Qwen25VLModel:
        model = Qwen25VLModel(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        return freeze_as_configured(model, self)


@MegatronModelBridge.register_bridge(
    source=Qwen2_5_VLForConditionalGeneration,
    target=Qwen25VLModel,
    provider=QvlQwen25VLModelProvider,
    model_type="qwen2_5_vl",
)
class Qwen25VLBridge(upstream_bridge.Qwen25VLBridge):
    """Megatron-Bridge's Qwen2.5-VL bridge, handing out qvl's provider; mappings inherited."""

    def provider_bridge(self, hf_pretrained) -> QvlQwen25VLModelProvider:
        return provider_as(QvlQwen25VLModelProvider, super().provider_bridge(hf_pretrained))
