"""The forward step for qvl's packed (THD) batches: one micro-batch through a Megatron Qwen-VL model."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from qvl.data.count import IGNORE_INDEX

# Batch fields passed to the model when present (Qwen2-VL / Qwen2.5-VL / Qwen3-VL forward arguments).
_VISUAL_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def model_inputs(batch: Any, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Keyword arguments for the model's forward and the loss mask, from a qvl PackedBatch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    labels = batch.labels.to(device)
    # Megatron's cross-entropy has no ignore index: learn nothing where labels are IGNORE_INDEX.
    loss_mask = (batch.loss_mask.to(device) > 0) & (labels != IGNORE_INDEX)
    cu = batch.cu_seqlens_q.to(device=device, dtype=torch.int32)
    kwargs = {
        "input_ids": batch.tokens.to(device),
        "labels": labels.clamp(min=0),
        "loss_mask": loss_mask.float(),
        "attention_mask": None,
        "position_ids": None,  # the model derives 3-D mRoPE positions per sub-sequence itself
        "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                             max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen),
    }  # fmt: skip
    for name in _VISUAL_FIELDS:
        value = getattr(batch, name, None)
        if value is not None and value.numel():
            kwargs[name] = value.to(device)
    return kwargs, loss_mask.float()


def forward_step(state: Any, data_iterator: Iterator, model: Any, return_schedule_plan: bool = False):
    """Megatron-Bridge forward step: next packed batch through the model, masked per-token loss."""
    from megatron.bridge.training.losses import masked_next_token_loss

    device = next(model.parameters()).device
    kwargs, loss_mask = model_inputs(next(data_iterator), device)
    output = model(**kwargs)
    if isinstance(output, tuple):  # some VLM paths return (losses, loss_mask) under context parallelism
        output, loss_mask = output
    checks = state.cfg.rerun_state_machine
    return output, partial(masked_next_token_loss, loss_mask, check_for_nan_in_loss=checks.check_for_nan_in_loss,
                           check_for_spiky_loss=checks.check_for_spiky_loss)  # fmt: skip
