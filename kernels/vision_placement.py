"""Where a packed micro-batch's vision features go, computed on the host from its tokens and grids (no device read):
the placeholder positions, and the order in which the vision tower encodes the micro-batch's images and videos.

Megatron-Bridge 0.6.2's Qwen3-VL forward finds both on the device: a boolean mask of the placeholder tokens (its
count read on the host) and, for a pack with both images and videos, upstream's `reorganize_inputs`
(megatron/bridge/models/qwen_vl/modelling_qwen3_vl/utils.py: both grids `.tolist()`-ed, the device tokens scanned
for placeholder runs). qvl's loader has the pack's tokens and grids on the host: the step computes there the
placeholder positions and, for a pack with both kinds, their token order (`host_vision_placement`: the grid in token
order, each one's pixel rows, and the tower's precomputed inputs put in that order), copies them to the device with
the batch and passes them to the model's forward (qvl.kernels.speed_qwen3_vl_sync_free.indexed_forward).

Where the step gives each distinct image (video) of the micro-batch once (the loader's `image_sources`: a preference
pair's sides share their images), `host_vision_placement` orders the tower's work by distinct item (`distinct_order`:
the distinct images, then the distinct videos, with their tower inputs) and says where each placeholder's feature
rows are in the tower's output (`VisionOrder.feature_rows`). Images and videos may be mixed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from qvl.foundation.errors import QvlError
from qvl.kernels.tower_inputs import MegatronTowerInputs, first_occurrences

IMAGES, VIDEOS = 0, 1  # the pixel tensor a row range of `VisionOrder.pixel_rows` is in


class VisionPositionsMismatch(QvlError, ValueError):
    """Host-computed vision positions or order that do not fit the micro-batch's grids or vision features."""


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
    offsets = [0, *itertools.accumulate(h * w for _, h, w in grids)][:-1]  # each grid's first position column
    return MegatronTowerInputs(
        grids=grids,
        pos_embed_index=torch.cat([index for _, index, _, _, _ in chosen], dim=1),
        pos_embed_weight=torch.cat([weight for _, _, weight, _, _ in chosen], dim=1),
        position_ids=torch.cat([ids for *_, ids, _ in chosen]),
        max_hw=max((max(h, w) for _, h, w in grids), default=0),
        cu_seqlens=cu,
        max_seqlen=max((h * w for _, h, w in grids), default=0),  # one block per frame
        pos_embed_order=torch.cat([order + offset for (*_, order), offset in zip(chosen, offsets, strict=True)]),
    )


def _pieces_by_grid(inputs: MegatronTowerInputs | None) -> list[tuple]:
    """(grid, position-table corners, their weights, rotary position ids, position-column order counted from the
    grid's first column) of each grid of `inputs`."""
    if inputs is None:
        return []
    per_frame = [h * w for _, h, w in inputs.grids]
    per_grid = [t * h * w for t, h, w in inputs.grids]
    offsets = [0, *itertools.accumulate(per_frame)][:-1]
    orders = [order - offset for order, offset in zip(inputs.pos_embed_order.split(per_grid), offsets, strict=True)]
    return list(
        zip(
            inputs.grids,
            inputs.pos_embed_index.split(per_frame, dim=1),
            inputs.pos_embed_weight.split(per_frame, dim=1),
            inputs.position_ids.split(per_grid),
            orders,
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
