"""The body of qvl's Qwen3-VL forward (qvl.bridges.qwen3_vl, Qwen3-VL and Qwen3.5-VL) without host reads: the
vision placeholder positions of a pack as host-computed indices instead of a boolean mask.

Megatron-Bridge 0.6.2's `Qwen3VLModel.forward` (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py) puts the
vision features into the token embeddings with `combined_embeddings[vision_mask] = vision_embeds`, and its decoder
adds each deepstack feature at the same places (`Qwen3VLTransformerBlock._deepstack_process` in
transformer_block.py: `hidden_states[visual_pos_masks, :]`, read and written). Indexing with a boolean mask needs the
number of True entries on the host, so on a GPU each of them waits for the device, forward and backward: 144 of the
151 host syncs of a Qwen3-VL-4B step of 8 packs (benchmarks/RESULTS.md).

A micro-batch with both images and videos reads more: upstream's `reorganize_inputs` (utils.py) puts the pixels into
token order for the tower, reading both grids with `.tolist()` and scanning the device tokens for the placeholder
runs (`find_vision_id_index`: a `nonzero`, two boolean selections, three `.tolist()`), then builds a new device grid
in that order.

qvl's loader has the pack's tokens and grids on the host: the step computes there the placeholder positions and,
for a pack with both kinds, the order of its images and videos (qvl.kernels.vision_placement: the grid in token order, each
one's pixel rows, and the tower's precomputed inputs put in that order), copies them to the device with the batch
and passes them to the model's forward (in its `host_batch`). qvl's Qwen3-VL model, a subclass of upstream's, then
runs `indexed_forward` for a packed (THD) micro-batch: `index_copy_` and the pixels gathered by those row ranges,
the tower given the loader's inputs (qvl.kernels.speed_qwen3_vl_tower), and its decoder, qvl's subclass too, adds
the deepstack features at those indices (`add_deepstack_at`: `index_select` / `index_copy_`): sizes known from
shapes, values and gradients bitwise the masked version's (tests/kernels/test_speed_qwen3_vl_sync_free.py). A call
without a placement, or on a path qvl's step does not take (context parallelism, sequence parallelism over
tensor-parallel ranks, a pipeline stage without embeddings, caller-given masks), runs upstream's forward unchanged.

Where the step gives each distinct image (video) of the micro-batch once (the loader's `image_sources`: a preference
pair's sides share their images), qvl.kernels.vision_placement orders the tower's work by distinct item (`distinct_order`:
the distinct images, then the distinct videos, with their tower inputs) and says where each placeholder's feature
rows are in the tower's output (`VisionOrder.feature_rows`): the embeddings and every deepstack feature are gathered
by that index before they are placed, so the tower runs once per distinct item and the backward of the gather sums
the gradients of every placeholder of an item into that one pass. Images and videos may be mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qvl.foundation.errors import QvlError
from qvl.kernels import speed_cuda_graphs
from qvl.kernels.tower_graphs import megatron_tower_graphs
from qvl.kernels.tower_inputs import MegatronTowerInputs
from qvl.kernels.vision_placement import IMAGES, VIDEOS, VisionOrder, VisionPlacement, VisionPositionsMismatch


class VisionTowerOutputError(QvlError, RuntimeError):
    """A vision tower whose output is not one row per merged patch of its input: a defect of the model, not the data."""


def check_tower_rows(tower: torch.nn.Module, outputs: Sequence[torch.Tensor], pixel_rows: int, merged: int) -> None:
    """Refuse tower `outputs` (its embeddings, and Qwen3-VL's deepstack features) other than [pixel_rows / merged,
    hidden] (shapes only, no host read), naming the tower: the data checks then see only what the data decides."""
    expected = pixel_rows // merged
    for embeds in outputs:
        if embeds.dim() != 2 or embeds.shape[0] != expected:
            raise VisionTowerOutputError(
                f"the vision tower ({type(tower).__name__}) returned embeddings of shape {list(embeds.shape)} for "
                f"{pixel_rows} patches, where [{expected}, hidden] (one row per {merged} patches) is due; the model "
                "is at fault, not the data: look at what wraps or patches the tower (its mergers' linears first)"
            )


def takes_indexed_path(
    model: Any,
    *,
    input_ids: Any,
    position_ids: Any,
    inference_params: Any,
    packed_seq_params: Any,
    image_input_mask: Any,
    video_input_mask: Any,
) -> bool:
    """Whether a forward call is the packed single-CP-rank path `indexed_forward` reproduces."""
    split_over_tp = model.config.sequence_parallel and model.pg_collection.tp.size() > 1
    return (
        model.pre_process
        and model.language_model is not None
        and not model.use_dist_train
        and inference_params is None
        and packed_seq_params is not None
        and packed_seq_params.qkv_format == "thd"
        and isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and input_ids.size(0) == 1
        and isinstance(position_ids, torch.Tensor)  # explicit mRoPE positions [3, b, s], as the loader gives
        and position_ids.dim() == 3
        and position_ids.size(0) == 3
        and image_input_mask is None
        and video_input_mask is None
        and model.pg_collection.cp.size() == 1
        and not split_over_tp  # upstream splits the deepstack features per rank with a `.tolist()`
    )


def _vision_inputs(
    model: Any,
    input_ids: torch.Tensor,
    images: tuple[torch.Tensor | None, torch.Tensor | None, Any],
    videos: tuple[torch.Tensor | None, torch.Tensor | None, Any],
    order: VisionOrder | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, MegatronTowerInputs | None]:
    """The tower's pixels, grid and precomputed inputs (None where the loader gave none for that grid), as upstream's
    `reorganize_inputs` gives pixels and grid (without building the mask); for images and videos in the order
    computed on the host where the step gave it. `images` and `videos`: (pixels, grid, the loader's tower inputs)."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import reorganize_inputs

    (image_pixels, image_grid, _), (video_pixels, video_grid, _) = images, videos
    mixed = image_pixels is not None and video_pixels is not None
    if order is not None and (mixed or order.feature_rows is not None):
        return _pixels_in_token_order(image_pixels, video_pixels, order), order.grid_thw, order.tower_inputs
    if mixed:  # re-ordered into token order, reading the grids
        data, grid, _ = reorganize_inputs(
            input_ids=input_ids,
            pixel_values=image_pixels,
            pixel_values_videos=video_pixels,
            image_grid_thw=image_grid,
            video_grid_thw=video_grid,
            image_token_id=model.image_token_id,
            video_token_id=model.video_token_id,
            square_merge_size=model.square_merge_size,
        )
        return data, grid, None  # upstream's new grid: the tower computes its own inputs
    pixels, grid, inputs = images if image_pixels is not None else videos
    return pixels, grid, inputs if isinstance(inputs, MegatronTowerInputs) else None


def _pixels_in_token_order(
    images: torch.Tensor | None, videos: torch.Tensor | None, order: VisionOrder
) -> torch.Tensor:
    """Upstream's concatenation of each image's and video's pixel rows in token order (or the order's own), the rows
    known on the host."""
    given = tuple(0 if pixels is None else pixels.shape[0] for pixels in (images, videos))
    if given != order.pixel_counts:
        raise VisionPositionsMismatch(
            f"the micro-batch has {given[IMAGES]} image and {given[VIDEOS]} video pixel rows, its grids "
            f"{order.pixel_counts[IMAGES]} and {order.pixel_counts[VIDEOS]}; prepare the dataset again with "
            "`qvl data prepare` for this checkpoint's processor"
        )
    pixels = (images, videos)
    return torch.cat([pixels[kind][start:end] for kind, start, end in order.pixel_rows])


def _vision_features(
    model: Any, data: torch.Tensor | None, grid: torch.Tensor | None, tower_inputs: MegatronTowerInputs | None
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The tower's embeddings and deepstack features, or (None, None) without vision, as upstream computes them."""
    if grid is None or grid.shape[0] == 0:
        return None, None
    if data.shape[0] > 0:
        graphs = megatron_tower_graphs(model)
        if graphs is not None:  # replayed as CUDA graphs (speed-cuda-graphs)
            embeds, deepstack = graphs(data, tower_inputs, grid)
        else:
            embeds, deepstack = model.vision_model(hidden_states=data, grid_thw=grid, tower_inputs=tower_inputs)
        check_tower_rows(model.vision_model, [embeds, *(deepstack or ())], data.shape[0], model.square_merge_size)
        return embeds, deepstack
    dtype, device = model.config.params_dtype, data.device
    empty = torch.zeros((0, model.config.hidden_size), device=device, dtype=dtype)
    hidden = model.language_model.config.hidden_size
    deepstack = [
        torch.zeros((0, hidden), device=device, dtype=dtype)
        for _ in model.vision_transformer_config.deepstack_visual_indexes
    ]
    return empty, deepstack


def _embeddings(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, vision_embeds) -> torch.Tensor:
    """The decoder input [s, b, h]: token embeddings with the vision embeddings copied into `positions`' rows."""
    combined = model.language_model.embedding(input_ids=input_ids, position_ids=None).clone()  # [s, b, h]
    if vision_embeds is not None:
        if vision_embeds.shape[0] != positions.numel():
            raise VisionPositionsMismatch(
                f"the packed batch's grids give {vision_embeds.shape[0]} vision embeddings for {positions.numel()} "
                "vision placeholder tokens; its grids and placeholder tokens disagree: prepare the dataset again "
                "with `qvl data prepare` for this checkpoint's processor"
            )
        combined = combined.transpose(0, 1).contiguous()  # [b, s, h], as upstream masks it
        combined.view(-1, combined.shape[-1]).index_copy_(0, positions, vision_embeds)
        combined = combined.transpose(0, 1).contiguous()
    if model.config.sequence_parallel:
        from megatron.core import tensor_parallel

        combined = tensor_parallel.scatter_to_sequence_parallel_region(combined, group=model.pg_collection.tp)
        combined = combined.contiguous()
    return combined


def indexed_forward(
    model: Any,
    placement: VisionPlacement,
    *,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    packed_seq_params: Any,
    extra_block_kwargs: dict | None,
    pixel_values: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    image_tower_inputs: Any,
    video_tower_inputs: Any,
    runtime_gather_output: bool | None,
    **kwargs: Any,
):
    """Upstream's forward for a packed micro-batch on one CP rank (`takes_indexed_path`), the vision rows addressed
    by `placement`'s positions and the images and videos put in token order by its order; `kwargs` go to the language
    model as upstream passes its own."""
    positions = placement.positions
    torch.cuda.nvtx.range_push("Qwen3VLModel.forward.pre_process")
    data, grid, tower_inputs = _vision_inputs(
        model,
        input_ids,
        (pixel_values, image_grid_thw, image_tower_inputs),
        (pixel_values_videos, video_grid_thw, video_tower_inputs),
        placement.order,
    )
    vision_embeds, deepstack = _vision_features(model, data, grid, tower_inputs)
    if placement.order is not None:  # each distinct image encoded once: every placeholder gets its rows
        vision_embeds, deepstack = placement.order.placed(vision_embeds, deepstack)
    decoder_input = speed_cuda_graphs.graphable_input(
        model.config, _embeddings(model, input_ids, positions, vision_embeds)
    )
    model.language_model.rotary_pos_emb.is_thd_format = True
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push("Qwen3VLModel.forward.language_model")
    output = model.language_model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None,
        decoder_input=decoder_input,
        labels=labels,
        loss_mask=loss_mask,
        inference_params=None,
        packed_seq_params=packed_seq_params,
        runtime_gather_output=runtime_gather_output,
        visual_pos_masks=positions,  # int64 indices: qvl's decoder adds the deepstack features there
        deepstack_visual_embeds=deepstack,
        **(extra_block_kwargs or {}),
        **kwargs,
    )
    torch.cuda.nvtx.range_pop()
    return output


def add_deepstack_at(hidden_states: torch.Tensor, positions: torch.Tensor, visual_embeds: torch.Tensor) -> torch.Tensor:
    """Upstream's `_deepstack_process` with int64 row indices into the [b*s] tokens instead of a boolean mask:
    `hidden_states[mask, :] = hidden_states[mask, :].clone() + visual_embeds`, the same sums (each position once).
    Out of place: the hidden states may be a CUDA-graphed layer's output, which autograd forbids writing in place."""
    batch, tokens, width = hidden_states.shape[1], hidden_states.shape[0], hidden_states.shape[-1]
    rows = hidden_states.transpose(0, 1).reshape(-1, width)  # [b*s, h]
    rows = rows.index_add(0, positions, visual_embeds)
    return rows.view(batch, tokens, width).transpose(0, 1).contiguous()
