"""The forward step for qvl's packed (THD) batches: one micro-batch through a Megatron Qwen-VL model."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from qvl.data.count import IGNORE_INDEX
from qvl.foundation import patches
from qvl.kernels import speed_gated_delta_sync_free as gated_delta
from qvl.kernels.loss_rows import LossRows, host_loss_rows, loss_rows_output
from qvl.kernels.speed_cuda_graphs import GraphShapes, fixed_size_cu_seqlens, graph_shapes
from qvl.kernels.speed_qwen3_vl_sync_free import check_tower_rows
from qvl.kernels.speed_rotary import mark_whole_pack
from qvl.kernels.speed_sync_free import HostBatch, LossCheck, PlaceholderMismatchError, masked_loss
from qvl.kernels.switch import packs_padded
from qvl.kernels.tower_inputs import DistinctVision, VisionSources, distinct_rows, distinct_vision
from qvl.kernels.vision_placement import host_vision_placement
from qvl.training import mtp

# Batch fields passed to the model when present (Qwen2-VL / Qwen2.5-VL / Qwen3-VL forward arguments).
_VISUAL_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Each kind's pixels, grid and the loader's distinct index of each of its items (qvl.data.encode).
_KINDS = (
    ("pixel_values", "image_grid_thw", "image_sources"),
    ("pixel_values_videos", "video_grid_thw", "video_sources"),
)


def padded_length(model_config: Any, tokens: int) -> int | None:
    """The length a pack of `tokens` is padded to under `model_config`'s layout, None where it is not: `seq_length`
    under pipeline parallelism (stages exchange activations in buffers of one size); under sequence parallelism the
    next multiple of the tensor-parallel size (each rank holds an equal share of the sequence)."""
    if not packs_padded(model_config):
        return None
    if model_config.pipeline_model_parallel_size > 1:
        return model_config.seq_length
    tp = model_config.tensor_model_parallel_size
    return -(-tokens // tp) * tp if tokens % tp else None


def model_inputs(
    batch: Any, device: torch.device, pad_to: int | None = None, graph_shapes: GraphShapes | None = None
) -> tuple[dict, torch.Tensor]:
    """Keyword arguments for the model's forward and the loss mask, from a qvl PackedBatch.

    `pad_to` (`padded_length`): pipeline parallelism sends activations between stages in buffers of a fixed
    `seq_length`, and sequence parallelism splits the pack evenly over the tensor-parallel ranks, so a pack is padded
    with one extra sub-sequence of pad tokens that attends only to itself and carries no loss; its `PackedSeqParams`
    is then a `PaddedPack` that says where the pad starts, which an MoE router leaves out of its balancing statistics
    (qvl.kernels.fix_moe_pad_tokens).
    `graph_shapes`: where the language model's layers replay as CUDA graphs (qvl.kernels.speed_cuda_graphs), every
    pack is padded so, its `cu_seqlens` made a fixed-size tensor (inert zero-length sub-sequences at the end) and its
    `max_seqlen` the same for all; where a MoE layer's graphs are partial, every pack is a `PaddedPack` too.

    Where the loader says that images (videos) repeat in the micro-batch (`image_sources`: a preference pair's sides
    share them), the model is given each distinct one's pixels once, gathered on the host before the copy, and
    `vision_sources` (qvl.kernels.tower_inputs.VisionSources) to expand them back on any path that needs them whole.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels.fix_moe_pad_tokens import PaddedPack

    tokens, labels = to_device(batch.tokens, device), to_device(batch.labels, device)
    # Megatron's cross-entropy has no ignore index: learn nothing where labels are IGNORE_INDEX.
    loss_mask = (to_device(batch.loss_mask, device) > 0) & (labels != IGNORE_INDEX)
    cu = batch.cu_seqlens_q.to(torch.int32)  # the pack's bounds, made on the host and copied once
    pad_to = graph_shapes.tokens if graph_shapes is not None else pad_to
    padding = 0 if pad_to is None else pad_to - tokens.shape[1]
    if padding < 0:
        raise ValueError(
            f"a packed batch of {tokens.shape[1]} tokens exceeds seq_length={pad_to}; "
            "prepare the dataset with --seq-length <= the recipe's seq_length"
        )
    if padding > 0:
        tokens = torch.nn.functional.pad(tokens, (0, padding), value=0)
        labels = torch.nn.functional.pad(labels, (0, padding), value=0)
        loss_mask = torch.nn.functional.pad(loss_mask, (0, padding), value=False)
        cu = torch.cat([cu, cu.new_tensor([pad_to])])
    max_seqlen = max(batch.max_seqlen, padding)
    # a padded pack says where its pad starts, for an MoE router to leave it out (qvl.kernels.fix_moe_pad_tokens); not
    # under whole-layer graphs, whose captured arguments would then differ from pack to pack. Under a MoE layer's
    # partial graphs (its calls eager) every pack says so, padded or not: the mask is one of the router graph's inputs
    pack_params = PackedSeqParams
    if (padding > 0 and graph_shapes is None) or (graph_shapes is not None and not graph_shapes.whole_layers):
        pack_params = partial(PaddedPack, pad_from=pad_to - padding)
    if graph_shapes is not None:
        cu, max_seqlen = fixed_size_cu_seqlens(cu, graph_shapes.slots), graph_shapes.max_seqlen
    cu = device_bounds(cu, device)
    kwargs = {
        "input_ids": tokens,
        "labels": labels.clamp(min=0),
        "loss_mask": loss_mask.float(),
        "attention_mask": None,
        "position_ids": loader_positions(batch, device, padding),
        "packed_seq_params": pack_params(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
        ),
    }
    distinct, sources = distinct_pixels(batch)
    for name in _VISUAL_FIELDS:
        value = distinct.get(name, getattr(batch, name, None))
        if value is not None and value.numel():
            kwargs[name] = to_device(value, device)
    if sources is not None:
        kwargs["vision_sources"] = (sources.pin_memory() if pinned_copies(device) else sources).to(
            device, non_blocking=True
        )
    return kwargs, loss_mask.float()


def device_bounds(host_cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A pack's bounds (`cu_seqlens`, on the host) on `device`, marked as a whole pack's: it ends at the pack's last
    token, so the rotary reads nothing back (qvl.kernels.speed_rotary). Where Gated DeltaNet layers read nothing back
    either (qvl.kernels.speed_gated_delta_sync_free applied), with the host values and the chunk list they take."""
    cu = mark_whole_pack(to_device(host_cu, device))
    if not patches.is_applied(gated_delta.GROUP) or host_cu.device.type != "cpu":
        return cu
    return gated_delta.with_host_bounds(cu, host_cu, to_device(gated_delta.chunk_list(host_cu), device))


def distinct_pixels(batch: Any) -> tuple[dict[str, torch.Tensor], VisionSources | None]:
    """Each kind's pixels with every distinct image (video) once, where the loader's sources say some repeat, and the
    `VisionSources` that expand them back (host tensors); ({}, None) where nothing repeats."""
    pixels, rows = {}, {}
    for name, grid, field in _KINDS:
        sources, value = getattr(batch, field, None), getattr(batch, name, None)
        if sources is not None and value is not None:
            taken, rows[name] = distinct_rows(sources, getattr(batch, grid).prod(-1))
            pixels[name] = value.index_select(0, taken)
    if not rows:
        return {}, None
    return pixels, VisionSources(image_rows=rows.get("pixel_values"), video_rows=rows.get("pixel_values_videos"))


def loader_positions(batch: Any, device: torch.device, padding: int) -> torch.Tensor | None:
    """The loader's 3-D mRoPE positions [3, 1, T] on `device` (a pad sub-sequence counts from 0, as transformers'
    `get_rope_index` numbers text); None for a batch without them."""
    positions = getattr(batch, "position_ids", None)
    if positions is None:
        return None
    if padding > 0:
        pad = torch.arange(padding, dtype=positions.dtype).expand(positions.shape[0], 1, padding)
        positions = torch.cat([positions, pad], dim=-1)
    return to_device(positions, device)


def host_batch(model: Any, batch: Any, kwargs: dict, device: torch.device) -> HostBatch:
    """What the loader computed on the host for `batch`, for the model's forward to take instead of reading the
    device back (qvl.kernels.speed_sync_free): its tokens and grids, the tower's inputs for the grids the model is
    given and, for Qwen3-VL, the vision rows as indices and a pack's images and videos in token order with the
    tower's inputs for that order (qvl.kernels.vision_placement); where `kwargs` hold each distinct image
    once (`model_inputs`), the distinct grids and where each placeholder's features are in the tower's output
    (`DistinctVision`); tensors the forward uses on `device`."""
    placement = host_vision_placement(model, batch, kwargs)
    if placement is not None:
        placement = (placement.pin_memory() if pinned_copies(device) else placement).to(device, non_blocking=True)
    # with images and videos in one placement the tower is given the token-order grid: its inputs, not each kind's
    per_kind = (
        {} if placement is not None and placement.has_tower_inputs() else tower_inputs_by_kind(batch, kwargs, device)
    )
    distinct = distinct_vision_by_kind(model, batch, kwargs, device)
    return HostBatch(
        tokens=batch.tokens,
        image_grid_thw=getattr(batch, "image_grid_thw", None),
        video_grid_thw=getattr(batch, "video_grid_thw", None),
        image_tower_inputs=per_kind.get("image_grid_thw"),
        video_tower_inputs=per_kind.get("video_grid_thw"),
        vision_placement=placement,
        image_sources=distinct.get("pixel_values"),
        video_sources=distinct.get("pixel_values_videos"),
    )


def distinct_vision_by_kind(model: Any, batch: Any, kwargs: dict, device: torch.device) -> dict[str, DistinctVision]:
    """The `DistinctVision` of each kind whose distinct pixels `kwargs` hold (on `device`), by its pixel argument;
    empty on a stage without the vision tower."""
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    found = {}
    for name, grid, field in _KINDS:
        sources = getattr(batch, field, None)
        if sources is None or kwargs.get(name) is None or not getattr(vlm, "pre_process", True):
            continue
        distinct = distinct_vision(sources, getattr(batch, grid), vlm.square_merge_size)
        found[name] = (distinct.pin_memory() if pinned_copies(device) else distinct).to(device, non_blocking=True)
    return found


def pinned_copies(device: torch.device) -> bool:
    """Whether host-to-device copies to `device` go through pinned memory, asynchronously (CUDA)."""
    return device.type == "cuda"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; to a GPU from pinned memory without blocking the host (a pageable copy waits for the
    GPU: the H100 profile of benchmarks/RESULTS.md shows 116 of them per step)."""
    if pinned_copies(device) and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def forward_step(
    state: Any,
    data_iterator: Iterator,
    model: Any,
    return_schedule_plan: bool = False,
    *,
    loss_check: LossCheck | None = None,
):
    """Megatron-Bridge forward step: next packed batch through the model, masked per-token loss. `loss_check`: where
    the step's micro-batch losses are kept for one NaN/Inf check after the step (qvl.kernels.speed_sync_free; the
    registry's patched `train_step` passes it), instead of each loss being read as it comes."""
    device = next(model.parameters()).device
    model_config = state.cfg.model
    batch = next(data_iterator)
    pad_to = padded_length(model_config, batch.tokens.shape[1])
    kwargs, loss_mask = model_inputs(batch, device, pad_to=pad_to, graph_shapes=graph_shapes(state.cfg))
    if state.cfg.qvl.vision_balance:
        kwargs = balanced_vision_inputs(model, kwargs)
    with mtp.states_kept(model_config):
        output = model(
            **kwargs, **output_arguments(state.cfg, batch, device), host_batch=host_batch(model, batch, kwargs, device)
        )
    if isinstance(output, tuple):  # some VLM paths return (losses, loss_mask) under context parallelism
        output, loss_mask = output
    checks = state.cfg.rerun_state_machine
    main_loss = partial(
        masked_loss,
        loss_mask,
        check_for_nan_in_loss=checks.check_for_nan_in_loss,
        check_for_spiky_loss=checks.check_for_spiky_loss,
        loss_check=loss_check,
    )
    return output, mtp.loss_function(main_loss, model_config)


def output_arguments(cfg: Any, batch: Any, device: torch.device) -> dict[str, Any]:
    """The language model's output processor and its context (Megatron-Core's `GPTModel._postprocess` hook): with MTP
    layers the one that also returns their per-token losses (qvl.training.mtp), else `loss_rows_arguments`'; each
    head at its loss-bearing rows only with `qvl.loss_rows_only`."""
    depths = mtp.mtp_depths(cfg.model)
    if depths:
        return mtp.model_arguments(cfg.model, loss_rows(cfg, batch, device, mtp_depths=depths))
    return loss_rows_arguments(cfg, batch, device)


def loss_rows_arguments(cfg: Any, batch: Any, device: torch.device) -> dict[str, Any]:
    """With `qvl.loss_rows_only`, the output processor that runs the output layer and the loss at the pack's
    loss-bearing positions only (qvl.kernels.loss_rows); none where `loss_rows` gives none."""
    rows = loss_rows(cfg, batch, device)
    return {} if rows is None else {"output_processor": loss_rows_output, "output_processor_context": rows}


def loss_rows(cfg: Any, batch: Any, device: torch.device, *, mtp_depths: int = 0) -> LossRows | None:
    """The pack's loss-bearing positions (and each MTP depth's) on `device`, with `qvl.loss_rows_only`; None under
    context parallelism (a rank holds a slice of the pack) or for a micro-batch of more than one pack."""
    if not cfg.qvl.loss_rows_only or cfg.model.context_parallel_size > 1:
        return None
    found = host_loss_rows(
        batch.loss_mask, batch.labels, ignore_index=IGNORE_INDEX, cu_seqlens=batch.cu_seqlens_q, mtp_depths=mtp_depths
    )
    if found is None:
        return None
    main, *depths = (to_device(rows, device) for rows in found)
    return LossRows(rows=main, mtp_rows=tuple(depths))


def tower_inputs_by_kind(batch: Any, kwargs: dict, device: torch.device) -> dict[str, Any]:
    """The loader's tower inputs (qvl.kernels.tower_inputs) on `device`, by the grid argument they are for
    ("image_grid_thw", "video_grid_thw"), for the kinds the model is given; the tower then reads nothing back."""
    found = {}
    for grid, field in (("image_grid_thw", "image_tower_inputs"), ("video_grid_thw", "video_tower_inputs")):
        inputs = getattr(batch, field, None)
        if inputs is not None and grid in kwargs:
            pinned = inputs.pin_memory() if pinned_copies(device) else inputs
            found[grid] = pinned.to(device, non_blocking=True)
    return found


def balanced_vision_inputs(model: Any, kwargs: dict) -> dict:
    """`kwargs` with the vision work spread over the first pipeline stage's data- x tensor-parallel ranks, each image
    encoded once (qvl.training.vision_balance): the image and video embeddings are scattered into
    `inputs_embeds` here and the pixels dropped, so the model skips its own tower; the grids stay, for mRoPE
    positions. Collective: every DP x TP rank of the first pipeline stage calls it for every micro-batch, with or
    without images. Qwen2-VL / Qwen2.5-VL (Qwen25VLModel, HF tower replicated over TP) only.
    """
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    if not vlm.pre_process:  # a later pipeline stage: its inputs are the previous stage's activations
        return kwargs
    kwargs = dict(kwargs)
    if (sources := kwargs.pop("vision_sources", None)) is not None:  # balanced as given: repeated images expanded back
        pixels = sources.expanded(kwargs.pop("pixel_values", None), kwargs.pop("pixel_values_videos", None))
        kwargs |= {
            name: value for name, value in zip(("pixel_values", "pixel_values_videos"), pixels) if value is not None
        }
    input_ids = kwargs["input_ids"]
    embeds = _balanced_vision_embeddings(vlm, kwargs)
    # As Qwen25VLModel.forward embeds when it is given no inputs_embeds ([s, b, h] -> [b, s, h]); it still
    # transposes back and scatters for sequence parallelism when it is given them.
    inputs_embeds = vlm.language_model.embedding(input_ids=input_ids, position_ids=None).transpose(1, 0).contiguous()
    if embeds is not None:
        image_mask, video_mask = vlm.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds)
        n_image, n_video = int(image_mask.sum()), int(video_mask.sum())
        if embeds.shape[0] != n_image + n_video:
            raise PlaceholderMismatchError(
                f"the packed batch's grids give {embeds.shape[0]} vision embeddings for {n_image} image and {n_video} "
                "video placeholder tokens; its grids and placeholder tokens disagree: prepare the dataset again with "
                "`qvl data prepare` for this checkpoint's processor"
            )
        # masked_scatter keeps even an empty `embeds` in the graph: its backward (an all_to_all) is collective too.
        embeds = embeds.to(inputs_embeds.dtype)
        inputs_embeds = inputs_embeds.masked_scatter(image_mask, embeds[:n_image])
        inputs_embeds = inputs_embeds.masked_scatter(video_mask, embeds[n_image:])
    kwargs["inputs_embeds"] = inputs_embeds
    return kwargs


def _balanced_vision_embeddings(vlm: Any, kwargs: dict) -> torch.Tensor | None:
    """Pop the pixels from `kwargs` and encode images, then videos, in one balanced call (they share the tower)."""
    from megatron.core import parallel_state

    from qvl.recipes.shapes import model_shapes
    from qvl.training.vision_balance import balanced_vision_forward

    pixels = [kwargs.pop(name, None) for name in ("pixel_values", "pixel_values_videos")]
    grids = [kwargs[grid] for grid, p in zip(("image_grid_thw", "video_grid_thw"), pixels) if p is not None]
    pixels = [p for p in pixels if p is not None]
    embeds = balanced_vision_forward(
        lambda rows, grid: torch.cat(vlm.get_image_features(rows, grid, return_dict=True).pooler_output),
        torch.cat(pixels) if pixels else None,
        torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long, device=kwargs["input_ids"].device),
        shape=model_shapes(vlm.config)[1],
        # The first stage's DP x TP ranks (context parallelism is refused with vision_balance); a replica's TP
        # ranks share its micro-batch, so its DP rank names it.
        group=parallel_state.get_tensor_and_data_parallel_group(),
        replica=parallel_state.get_data_parallel_rank(),
        grad_scale=tower_grad_scale(vlm.visual, parallel_state.get_tensor_model_parallel_world_size()),
        pixel_dtype=torch.float32,  # what qvl.data.encode's image processor yields, on every rank
    )
    if embeds is not None:
        check_tower_rows(vlm.visual, [embeds], sum(p.shape[0] for p in pixels), vlm.visual.spatial_merge_size**2)
    return embeds


def tower_grad_scale(tower: torch.nn.Module, tensor_parallel: int) -> int:
    """What each rank's partial tower gradient is multiplied by so that training's reduction yields the full one.

    Megatron-Bridge marks a replicated HF tower's parameters `average_gradients_across_tp_domain`, and
    `finalize_model_grads` then AVERAGES their gradients over the TP group (right when every TP rank encoded
    every image). With each image encoded on one rank the average must become a sum: TP x the partial gradients,
    averaged, is their sum (exact: TP is a power of two in practice). Unmarked parameters would not be reduced
    over TP at all, so a tower with any such parameter is refused rather than silently trained on a fraction.
    """
    flags = {bool(getattr(p, "average_gradients_across_tp_domain", False)) for p in tower.parameters()}
    if tensor_parallel == 1:
        return 1
    if flags != {True}:
        raise ValueError(
            "vision_balance with tensor_parallel > 1 needs every vision-tower parameter marked "
            "average_gradients_across_tp_domain (Megatron-Bridge's hook_hf_module_setattr_for_tp_grad_sync), so "
            "that its gradient is reduced over the TP group; mark the tower, or train with vision_balance=false"
        )
    return tensor_parallel
