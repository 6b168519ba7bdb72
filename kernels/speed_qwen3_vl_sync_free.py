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
for a pack with both kinds, the order of its images and videos (`host_vision_placement`: the grid in token order, each
one's pixel rows, and the tower's precomputed inputs put in that order), copies them to the device with the batch
and passes them to the model's forward (in its `host_batch`). qvl's Qwen3-VL model, a subclass of upstream's, then
runs `indexed_forward` for a packed (THD) micro-batch: `index_copy_` and the pixels gathered by those row ranges,
the tower given the loader's inputs (qvl.kernels.speed_qwen3_vl_tower), and its decoder, qvl's subclass too, adds
the deepstack features at those indices (`add_deepstack_at`: `index_select` / `index_copy_`): sizes known from
shapes, values and gradients bitwise the masked version's (tests/kernels/test_speed_qwen3_vl_sync_free.py). A call
without a placement, or on a path qvl's step does not take (context parallelism, sequence parallelism over
tensor-parallel ranks, a pipeline stage without embeddings, caller-given masks), runs upstream's forward unchanged.

Where the step gives each distinct image (video) of the micro-batch once (the loader's `image_sources`: a preference
pair's sides share their images), `host_vision_placement` orders the tower's work by distinct item (`distinct_order`:
the distinct images, then the distinct videos, with their tower inputs) and says where each placeholder's feature
rows are in the tower's output (`VisionOrder.feature_rows`): the embeddings and every deepstack feature are gathered
by that index before they are placed, so the tower runs once per distinct item and the backward of the gather sums
the gradients of every placeholder of an item into that one pass. Images and videos may be mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from qvl.foundation.errors import QvlError
from qvl.kernels.tower_inputs import MegatronTowerInputs, first_occurrences

IMAGES, VIDEOS = 0, 1  # the pixel tensor a row range of `VisionOrder.pixel_rows` is in


class VisionPositionsMismatch(QvlError, ValueError):
    """Host-computed vision positions or order that do not fit the micro-batch's grids or vision features."""


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


class TakesVisionPlacement:
    """A Qwen3-VL model class whose forward takes the step's `VisionPlacement` (qvl.bridges.qwen3_vl.Qwen3VLModel): the
    step computes one for its micro-batches."""


@dataclass(kw_only=True, slots=True)
class VisionOrder:
    """A micro-batch's images and videos in the order the tower encodes them, computed on the host: token order, what
    upstream's `reorganize_inputs` computes from the device tokens and grids; or, where the model is given each
    distinct item once, the distinct images then the distinct videos, and where each placeholder's features are."""

    grid_thw: torch.Tensor  # [images + videos, 3]: their grids in the tower's order (its `grid_thw`)
    pixel_rows: tuple[tuple[int, int, int], ...]  # (IMAGES or VIDEOS, first row, end row) of each, in that order
    pixel_counts: tuple[int, int]  # the image and video pixel rows the grids account for
    tower_inputs: MegatronTowerInputs | None = None  # the tower's inputs for `grid_thw`, where the loader gave them
    # int64 [vision tokens]: each placeholder's row in the tower's output, in token order; None: the output is in
    # token order already
    feature_rows: torch.Tensor | None = None

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> VisionOrder:
        """The same order with its tensors on `device`."""
        return self._mapped(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> VisionOrder:
        """Page-locked copies, so that `to(cuda, non_blocking=True)` overlaps."""
        return self._mapped(lambda t: t.pin_memory())

    def _mapped(self, function: Any) -> VisionOrder:
        inputs, rows = self.tower_inputs, self.feature_rows
        return replace(
            self,
            grid_thw=function(self.grid_thw),
            tower_inputs=None if inputs is None else function(inputs),
            feature_rows=None if rows is None else function(rows),
        )

    def placed(
        self, embeds: torch.Tensor | None, deepstack: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The tower's embeddings and deepstack features with one row per placeholder, in token order."""
        if self.feature_rows is None or embeds is None:
            return embeds, deepstack
        gathered = [features.index_select(0, self.feature_rows) for features in deepstack or ()]
        return embeds.index_select(0, self.feature_rows), gathered if deepstack is not None else None


@dataclass(kw_only=True, slots=True)
class VisionPlacement:
    """Where a micro-batch's vision features go, computed on the host from its tokens and grids."""

    positions: torch.Tensor  # [vision tokens] int64: their flat indices into the [b*s] tokens, ascending
    order: VisionOrder | None = None  # with both images and videos: the tower's inputs in token order

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> VisionPlacement:
        """The same placement with its tensors on `device`."""
        order = None if self.order is None else self.order.to(device, non_blocking=non_blocking)
        return VisionPlacement(positions=self.positions.to(device, non_blocking=non_blocking), order=order)

    def pin_memory(self) -> VisionPlacement:
        """Page-locked copies, so that `to(cuda, non_blocking=True)` overlaps."""
        order = None if self.order is None else self.order.pin_memory()
        return VisionPlacement(positions=self.positions.pin_memory(), order=order)

    def has_tower_inputs(self) -> bool:
        """Whether the placement holds the tower's inputs for the token-order grid of a pack with both kinds."""
        return self.order is not None and self.order.tower_inputs is not None


def vision_token_positions(tokens: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """Ascending flat indices (int64) of the entries of `tokens` equal to one of `token_ids`: the rows a boolean mask
    of those tokens selects, in the same order."""
    flat = tokens.reshape(-1)
    return torch.isin(flat, torch.tensor(list(token_ids), dtype=flat.dtype)).nonzero().flatten()


def vision_order(
    tokens: torch.Tensor,
    image_grid_thw: torch.Tensor,
    video_grid_thw: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    square_merge_size: int,
) -> VisionOrder:
    """The images and videos of host `tokens` in token order, as upstream's `reorganize_inputs` orders them: each
    takes as many placeholder runs as its grid has frames, and its pixel rows follow the earlier ones of its kind."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import find_vision_id_index

    # upstream's own scan, on the host tokens: (start, end, token id) of each run of one placeholder id
    runs = find_vision_id_index(tokens.reshape(-1), image_token_id, video_token_id)
    grids = (image_grid_thw.tolist(), video_grid_thw.tolist())
    kinds = {image_token_id: IMAGES, video_token_id: VIDEOS}
    taken, rows = [0, 0], [0, 0]
    in_order, pixel_rows = [], []
    run = 0
    while run < len(runs):
        kind = kinds[runs[run][2]]
        if taken[kind] == len(grids[kind]):
            raise _order_mismatch(f"more {('image', 'video')[kind]} placeholder runs than its {len(grids[kind])} grids")
        t, h, w = grids[kind][taken[kind]]
        frames = runs[run : run + t]
        patches = sum(end - start for start, end, _ in frames) * square_merge_size
        if len(frames) != t or {token for *_, token in frames} != {runs[run][2]} or patches != t * h * w:
            raise _order_mismatch(f"the {('image', 'video')[kind]} of grid {[t, h, w]} has runs {frames}")
        in_order.append(grids[kind][taken[kind]])
        pixel_rows.append((kind, rows[kind], rows[kind] + patches))
        taken[kind], rows[kind], run = taken[kind] + 1, rows[kind] + patches, run + t
    if taken != [len(grids[IMAGES]), len(grids[VIDEOS])]:
        raise _order_mismatch(f"placeholders for {taken[IMAGES]} images and {taken[VIDEOS]} videos")
    return VisionOrder(
        grid_thw=torch.tensor(in_order, dtype=image_grid_thw.dtype).reshape(-1, 3),
        pixel_rows=tuple(pixel_rows),
        pixel_counts=(rows[IMAGES], rows[VIDEOS]),
    )


def _order_mismatch(found: str) -> VisionPositionsMismatch:
    return VisionPositionsMismatch(
        f"the packed batch's vision placeholders do not fit its grids ({found}); prepare the dataset again with "
        "`qvl data prepare` for this checkpoint's processor"
    )


def tower_inputs_in_order(
    images: MegatronTowerInputs | None, videos: MegatronTowerInputs | None, pixel_rows: Sequence[tuple[int, int, int]]
) -> MegatronTowerInputs:
    """The tower inputs of the images' and videos' grids in the order of `pixel_rows` (`VisionOrder`'s): each grid's
    pieces moved as they are (every field is computed grid by grid), the blocks counted again for the new order
    (None: a kind without items)."""
    from transformers.vision_utils import get_vision_cu_seqlens

    pieces = (_pieces_by_grid(images), _pieces_by_grid(videos))
    taken = [0, 0]
    chosen = []
    for kind, *_ in pixel_rows:
        chosen.append(pieces[kind][taken[kind]])
        taken[kind] += 1
    grids = tuple(grid for grid, *_ in chosen)
    cu = get_vision_cu_seqlens(torch.tensor(grids, dtype=torch.long).reshape(-1, 3))  # as megatron_tower_inputs
    return MegatronTowerInputs(
        grids=grids,
        pos_embed_index=torch.cat([index for _, index, _, _ in chosen], dim=1),
        pos_embed_weight=torch.cat([weight for _, _, weight, _ in chosen], dim=1),
        position_ids=torch.cat([ids for *_, ids in chosen]),
        max_hw=max((max(h, w) for _, h, w in grids), default=0),
        cu_seqlens=cu,
        max_seqlen=max((h * w for _, h, w in grids), default=0),  # one block per frame
    )


def _pieces_by_grid(inputs: MegatronTowerInputs | None) -> list[tuple]:
    """(grid, position-table corners, their weights, rotary position ids) of each grid of `inputs`."""
    if inputs is None:
        return []
    per_frame = [h * w for _, h, w in inputs.grids]
    per_grid = [t * h * w for t, h, w in inputs.grids]
    return list(
        zip(
            inputs.grids,
            inputs.pos_embed_index.split(per_frame, dim=1),
            inputs.pos_embed_weight.split(per_frame, dim=1),
            inputs.position_ids.split(per_grid),
        )
    )


def host_vision_positions(model: Any, host_tokens: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The vision placeholder positions of a micro-batch, computed from its host tokens, where `model`'s forward takes
    them (`TakesVisionPlacement`, on the stage that embeds); None elsewhere. The tokens that count are those of the
    pixels given, as upstream's `reorganize_inputs` masks."""
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    if not isinstance(vlm, TakesVisionPlacement) or not vlm.pre_process or host_tokens.shape[0] != 1:
        return None
    token_ids = [
        token_id
        for field, token_id in (("pixel_values", vlm.image_token_id), ("pixel_values_videos", vlm.video_token_id))
        if kwargs.get(field) is not None
    ]
    return vision_token_positions(host_tokens, token_ids) if token_ids else None


def host_vision_placement(model: Any, batch: Any, kwargs: dict) -> VisionPlacement | None:
    """The vision placement of a micro-batch (a qvl PackedBatch on the host, and the model inputs made of it), where
    `model`'s forward takes one (as `host_vision_positions`); None elsewhere. With both images and videos it holds
    their token order and, where the loader computed the tower's inputs per kind, those inputs in that order."""
    from megatron.core.utils import unwrap_model

    positions = host_vision_positions(model, batch.tokens, kwargs)
    if positions is not None and kwargs.get("vision_sources") is not None:
        return VisionPlacement(positions=positions, order=distinct_order(unwrap_model(model), batch, kwargs))
    if positions is None or kwargs.get("pixel_values") is None or kwargs.get("pixel_values_videos") is None:
        return None if positions is None else VisionPlacement(positions=positions)
    vlm = unwrap_model(model)
    order = vision_order(
        batch.tokens,
        batch.image_grid_thw,
        batch.video_grid_thw,
        image_token_id=vlm.image_token_id,
        video_token_id=vlm.video_token_id,
        square_merge_size=vlm.square_merge_size,
    )
    per_kind = [getattr(batch, name, None) for name in ("image_tower_inputs", "video_tower_inputs")]
    if all(isinstance(inputs, MegatronTowerInputs) for inputs in per_kind):
        order = replace(order, tower_inputs=tower_inputs_in_order(*per_kind, order.pixel_rows))
    return VisionPlacement(positions=positions, order=order)


def distinct_order(vlm: Any, batch: Any, kwargs: dict) -> VisionOrder:
    """The tower's order for a micro-batch whose model inputs hold each distinct image (video) once
    (qvl.training.step.model_inputs, from the loader's `image_sources` / `video_sources`): the distinct images, then
    the distinct videos, their tower inputs in that order, and each placeholder's rows in the tower's output."""
    kinds = []  # per kind: (grid of every item, each item's distinct index, the loader's tower inputs)
    for pixels, grid, sources, inputs in (
        ("pixel_values", "image_grid_thw", "image_sources", "image_tower_inputs"),
        ("pixel_values_videos", "video_grid_thw", "video_sources", "video_tower_inputs"),
    ):
        given = kwargs.get(pixels) is not None
        items = getattr(batch, grid).reshape(-1, 3) if given else torch.zeros(0, 3, dtype=torch.long)
        distinct = getattr(batch, sources, None) if given else None
        kinds.append((items, torch.arange(len(items)) if distinct is None else distinct, getattr(batch, inputs, None)))
    in_tokens = vision_order(
        batch.tokens,
        kinds[IMAGES][0],
        kinds[VIDEOS][0],
        image_token_id=vlm.image_token_id,
        video_token_id=vlm.video_token_id,
        square_merge_size=vlm.square_merge_size,
    )
    grids, pixel_rows, counts, first_feature = [], [], [0, 0], []
    features = 0  # rows of the tower's output before this kind's
    for kind, (items, sources, _) in enumerate(kinds):
        distinct = items[first_occurrences(sources)]
        patches = distinct.prod(-1)
        for rows in patches.tolist():
            pixel_rows.append((kind, counts[kind], counts[kind] + rows))
            counts[kind] += rows
        per_feature = patches // vlm.square_merge_size
        first_feature.append(features + per_feature.cumsum(0) - per_feature)
        features += int(per_feature.sum())
        grids.append(distinct)
    taken, feature_rows = [0, 0], []
    for kind, start, end in in_tokens.pixel_rows:  # each item in token order takes its distinct item's rows
        first = int(first_feature[kind][kinds[kind][1][taken[kind]]])
        feature_rows.append(torch.arange(first, first + (end - start) // vlm.square_merge_size))
        taken[kind] += 1
    per_kind = [inputs if counts[kind] else None for kind, (*_, inputs) in enumerate(kinds)]
    complete = all(isinstance(inputs, MegatronTowerInputs) for kind, inputs in enumerate(per_kind) if counts[kind])
    return VisionOrder(
        grid_thw=torch.cat(grids),
        pixel_rows=tuple(pixel_rows),
        pixel_counts=(counts[IMAGES], counts[VIDEOS]),
        tower_inputs=tower_inputs_in_order(*per_kind, pixel_rows) if complete else None,
        feature_rows=torch.cat(feature_rows) if feature_rows else torch.zeros(0, dtype=torch.long),
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
    decoder_input = _embeddings(model, input_ids, positions, vision_embeds)
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
    `hidden_states[mask, :] = hidden_states[mask, :].clone() + visual_embeds`, the same sum and copy."""
    hidden_states = hidden_states.transpose(0, 1).contiguous()  # [b, s, h]
    rows = hidden_states.view(-1, hidden_states.shape[-1])
    rows.index_copy_(0, positions, rows.index_select(0, positions) + visual_embeds)
    return hidden_states.transpose(0, 1).contiguous()
