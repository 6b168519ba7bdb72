"""What a replicated HF vision tower (Qwen2-VL, Qwen2.5-VL) derives from `grid_thw`, computed on the host once.

transformers 5.12 lets a caller hand a vision tower these values precomputed: each `get_vision_*` helper in
transformers/vision_utils.py pops its key (`position_ids`, `cu_seqlens`, `window_index`, `cu_window_seqlens`) from
the forward's kwargs before computing it. A tower that computes them itself from a CUDA `grid_thw` reads the grid
back to the host (`.tolist()`, twice per call) and loops over images in Python; its attention then turns each block's
`max_seqlen` tensor into an int (a host sync in every block). Computed here from a CPU `grid_thw` with the same
transformers functions, they cost no device sync, and the maximum lengths are Python ints. The loader computes them
in its worker processes; qvl's Qwen2-VL / Qwen2.5-VL forward hands them to the tower (qvl.kernels.speed_sync_free,
with qvl.kernels.speed_hf_vision's `tower_kwargs`).

Megatron-Bridge's Qwen3-VL tower (Qwen3-VL, Qwen3.5-VL; megatron/bridge/models/qwen_vl/modelling_qwen3_vl/
vision_model.py) derives more from its grid, with host reads of its own: the bilinear interpolation of its learned
position-embedding table (`fast_pos_embed_interpolate`, two `.tolist()` per corner per image), the rotary position
ids (`rot_pos_emb`, `.item()` twice and a loop over the device grid), the packed blocks (`build_packed_seq_params`,
whose longest block is a 0-d device tensor) and the split sizes of its output (`.tolist()`). `MegatronTowerInputs`
holds them, computed here with the same arithmetic in the same order, so that the tower's forward and backward are
bitwise upstream's; `qvl.kernels.speed_qwen3_vl_tower` hands them to the tower.

A micro-batch may show the tower one image several times (a preference pair's sides name the same image): the loader
marks each image's distinct index (`image_sources`, qvl.data.encode), the step gives the model each distinct image's
pixels once with `VisionSources` (each placeholder's pixel rows among them, for a path that takes one entry per
placeholder) and, for qvl's forwards, `DistinctVision` (the distinct grid the tower encodes and, per placeholder
feature row, its row in the tower's output): the tower runs once per distinct image and an `index_select` hands its
rows to every placeholder, whose backward sums their gradients into the one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass(kw_only=True, slots=True)
class TowerInputs:
    """One vision tower call's inputs derived from its `grid_thw` (images or videos of one micro-batch)."""

    position_ids: torch.Tensor  # [patches, 2] (row, col) of each patch, merge-block order
    cu_seqlens: torch.Tensor  # [n_grids * t + 1] int32: the full-attention blocks (one per frame)
    max_seqlen: int
    window_index: torch.Tensor | None = None  # [patches / merge^2]: merge units in window order (Qwen2.5-VL)
    cu_window_seqlens: torch.Tensor | None = None  # [windows + 1] int32
    max_window_seqlen: int | None = None

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TowerInputs:
        """The same inputs with every tensor on `device` (ints stay ints)."""
        return _tensors_mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TowerInputs:
        """Page-locked copies, so `to(cuda, non_blocking=True)` really overlaps (DataLoader's pin_memory calls this)."""
        return _tensors_mapped(self, torch.Tensor.pin_memory)

    def max_seqlens(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """(cu_seqlens tensor, its longest block) pairs, for an attention function handed one of these tensors."""
        pairs = [(self.cu_seqlens, self.max_seqlen)]
        if self.cu_window_seqlens is not None:
            pairs.append((self.cu_window_seqlens, self.max_window_seqlen))
        return tuple(pairs)


@dataclass(kw_only=True, slots=True)
class MegatronTowerInputs:
    """One call of Megatron-Bridge's Qwen3-VL vision tower: what it derives from its `grid_thw` (images or videos)."""

    grids: tuple[tuple[int, int, int], ...]  # (t, h, w) of each image or video, as Python ints
    pos_embed_index: torch.Tensor  # [4, sum h*w] long: bilinear corners in the position table, row-major per grid
    pos_embed_weight: torch.Tensor  # [4, sum h*w] float32: their weights (the tower casts them to its dtype)
    position_ids: torch.Tensor  # [patches, 2] long: (row, col) of each patch, merge-block order, frames repeated
    max_hw: int  # the largest grid height or width: rows of the rotary frequency table
    cu_seqlens: torch.Tensor  # [frames + 1] int32: one attention block per frame
    max_seqlen: int
    # [patches] long: each patch's column of pos_embed_index / _weight (merge-block order, frames repeated): the
    # tower's repeat-and-permute of the looked-up embeddings as one gather (its CUDA graphs, qvl.kernels.tower_graphs)
    pos_embed_order: torch.Tensor

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> MegatronTowerInputs:
        """The same inputs with every tensor on `device` (ints stay ints)."""
        return _tensors_mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> MegatronTowerInputs:
        """Page-locked copies, so `to(cuda, non_blocking=True)` really overlaps (DataLoader's pin_memory calls this)."""
        return _tensors_mapped(self, torch.Tensor.pin_memory)


def together(first: TowerInputs, second: TowerInputs, *, rows: int, merge_unit: int) -> TowerInputs:
    """The inputs of one call of `first`'s pixels (`rows` of them) followed by `second`'s: a micro-batch's images and
    videos through a replicated HF tower at once. The tower treats every image and frame on its own (its blocks and
    windows), so the call's output is `first`'s rows, then `second`'s. Device ops with host ints: nothing is read."""

    def shifted(cu: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return torch.cat([cu, other[1:] + rows])

    windows = first.window_index is not None
    return TowerInputs(
        position_ids=torch.cat([first.position_ids, second.position_ids]),
        cu_seqlens=shifted(first.cu_seqlens, second.cu_seqlens),
        max_seqlen=max(first.max_seqlen, second.max_seqlen),
        window_index=torch.cat([first.window_index, second.window_index + rows // merge_unit]) if windows else None,
        cu_window_seqlens=shifted(first.cu_window_seqlens, second.cu_window_seqlens) if windows else None,
        max_window_seqlen=max(first.max_window_seqlen, second.max_window_seqlen) if windows else None,
    )


def _tensors_mapped(inputs: Any, function: Any) -> Any:
    """A copy of a tower-inputs dataclass with `function` applied to each tensor field (other fields kept)."""
    mapped = {
        f.name: function(value) for f in fields(inputs) if isinstance(value := getattr(inputs, f.name), torch.Tensor)
    }
    return replace(inputs, **mapped)


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def tower_inputs(
    grid_thw: torch.Tensor, *, spatial_merge_size: int, patch_size: int, window_size: int | None = None
) -> TowerInputs:
    """The tower inputs of one `grid_thw` ([n, 3], on the CPU), computed by transformers' own functions.

    `window_size` (pixels) is given for towers with windowed attention (Qwen2.5-VL) and None for Qwen2-VL."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    if grid_thw.device.type != "cpu":
        raise ValueError(
            f"tower_inputs takes grid_thw on the CPU (got {grid_thw.device}); reading a device tensor back is the "
            "host sync this avoids: compute it from the loader's grid before the batch moves"
        )
    grid = grid_thw.reshape(-1, 3).long()
    cu = get_vision_cu_seqlens(grid)
    inputs = TowerInputs(
        position_ids=get_vision_position_ids(grid, spatial_merge_size), cu_seqlens=cu, max_seqlen=_longest(cu)
    )
    if window_size is not None:
        index, cu_window = get_vision_window_index(
            grid, spatial_merge_size=spatial_merge_size, window_size=window_size, patch_size=patch_size
        )
        inputs = replace(inputs, window_index=index, cu_window_seqlens=cu_window, max_window_seqlen=_longest(cu_window))
    return inputs


def megatron_tower_inputs(
    grid_thw: torch.Tensor, *, spatial_merge_size: int, num_position_embeddings: int
) -> MegatronTowerInputs:
    """The inputs of Megatron-Bridge's Qwen3-VL tower for one `grid_thw` ([n, 3], on the CPU)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    if grid_thw.device.type != "cpu":
        raise ValueError(
            f"megatron_tower_inputs takes grid_thw on the CPU (got {grid_thw.device}); reading a device tensor back "
            "is the host sync this avoids: compute it from the loader's grid before the batch moves"
        )
    grid = grid_thw.reshape(-1, 3).long()
    grids = tuple((int(t), int(h), int(w)) for t, h, w in grid.tolist())
    index, weight = _bilinear_corners(grids, side=int(num_position_embeddings**0.5))
    cu = get_vision_cu_seqlens(grid)  # transformers' helper; the same blocks as the tower's build_packed_seq_params
    return MegatronTowerInputs(
        grids=grids,
        pos_embed_index=index,
        pos_embed_weight=weight,
        position_ids=get_vision_position_ids(grid, spatial_merge_size),
        max_hw=max((max(h, w) for _, h, w in grids), default=0),
        cu_seqlens=cu,
        max_seqlen=_longest(cu),
        pos_embed_order=merge_block_order(grids, merge=spatial_merge_size),
    )


def merge_block_order(grids: tuple[tuple[int, int, int], ...], *, merge: int) -> torch.Tensor:
    """For each patch of `grids` in the tower's order (grid by grid, frame by frame, merge block by merge block), the
    index of its (row, col) among the grids' row-major positions (each grid's h*w after the previous grids'): the
    permutation upstream's `fast_pos_embed_interpolate` applies with `view(t, h/m, m, w/m, m).permute(0, 1, 3, 2, 4)`
    after repeating a grid's embeddings over its frames."""
    pieces, offset = [], 0
    for t, h, w in grids:
        frame = torch.arange(h * w).view(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
        pieces.append((frame + offset).repeat(t))
        offset += h * w
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _bilinear_corners(grids: tuple[tuple[int, int, int], ...], *, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The four bilinear corners of each patch in a `side` x `side` position table and their fp32 weights, computed
    as Megatron-Bridge 0.6.2's `Qwen3VLVisionModel.fast_pos_embed_interpolate` does (the same torch ops in the same
    order: bitwise its values), per grid in row-major order and once per grid, not per frame: the tower repeats
    the embeddings over frames and reorders them after the lookup, and keeping that order keeps its embedding
    gradient's summation order too. (transformers' `get_vision_bilinear_indices_and_weights` returns them
    reordered and repeated instead.)"""
    index_parts: list[list[torch.Tensor]] = [[] for _ in range(4)]
    weight_parts: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for _, h, w in grids:
        h_idxs, w_idxs = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        h_floor, w_floor = h_idxs.int(), w_idxs.int()
        h_ceil, w_ceil = (h_floor + 1).clip(max=side - 1), (w_floor + 1).clip(max=side - 1)
        dh, dw = h_idxs - h_floor, w_idxs - w_floor
        base_h, base_h_ceil = h_floor * side, h_ceil * side
        indices = (
            (base_h[None].T + w_floor[None]).flatten(),
            (base_h[None].T + w_ceil[None]).flatten(),
            (base_h_ceil[None].T + w_floor[None]).flatten(),
            (base_h_ceil[None].T + w_ceil[None]).flatten(),
        )
        weights = (
            ((1 - dh)[None].T * (1 - dw)[None]).flatten(),
            ((1 - dh)[None].T * dw[None]).flatten(),
            (dh[None].T * (1 - dw)[None]).flatten(),
            (dh[None].T * dw[None]).flatten(),
        )
        for corner in range(4):
            index_parts[corner].append(indices[corner].long())
            weight_parts[corner].append(weights[corner].float())
    if not grids:
        return torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0)
    return torch.stack([torch.cat(p) for p in index_parts]), torch.stack([torch.cat(p) for p in weight_parts])


def tower_inputs_for_config(grid_thw: torch.Tensor, vision_config: Any) -> TowerInputs | MegatronTowerInputs:
    """`tower_inputs` with the settings of an HF vision config (an object or its config.json dict); for a config
    with a learned position table (`num_position_embeddings`: Qwen3-VL, Qwen3.5-VL, whose tower qvl builds from
    Megatron-Bridge's) `megatron_tower_inputs`."""
    get = vision_config.get if isinstance(vision_config, dict) else lambda name: getattr(vision_config, name, None)
    if get("num_position_embeddings") is not None:
        return megatron_tower_inputs(
            grid_thw,
            spatial_merge_size=int(get("spatial_merge_size")),
            num_position_embeddings=int(get("num_position_embeddings")),
        )
    window_size = get("window_size")  # Qwen2.5-VL windows its attention; Qwen2-VL's config has no window_size
    return tower_inputs(
        grid_thw,
        spatial_merge_size=int(get("spatial_merge_size")),
        patch_size=int(get("patch_size")),
        window_size=None if window_size is None else int(window_size),
    )


def distinct_rows(sources: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For items of `sizes` rows each ([n], host) whose distinct index is `sources` ([n] int64, numbered in order of
    first occurrence): the rows of the items' concatenation that hold each distinct item once (`taken`), and each
    item's rows in that distinct concatenation (`expanded`, as many as the items' rows)."""
    sources, sizes = sources.long(), sizes.long()
    starts = sizes.cumsum(0) - sizes
    first = first_occurrences(sources)
    distinct_sizes = sizes[first]
    distinct_starts = distinct_sizes.cumsum(0) - distinct_sizes
    taken = torch.repeat_interleave(starts[first] - distinct_starts, distinct_sizes)
    taken += torch.arange(taken.numel())
    expanded = torch.repeat_interleave(distinct_starts[sources] - starts, sizes)
    expanded += torch.arange(expanded.numel())
    return taken, expanded


def first_occurrences(sources: torch.Tensor) -> torch.Tensor:
    """The index of each distinct item's first occurrence, in distinct order (`sources` numbered in that order)."""
    first = torch.zeros(int(sources.max()) + 1 if sources.numel() else 0, dtype=torch.long)
    return first.scatter_reduce_(0, sources.long(), torch.arange(len(sources)), reduce="amin", include_self=False)


@dataclass(kw_only=True, slots=True)
class VisionSources:
    """Where each placeholder's pixel rows are among a micro-batch's distinct pixels, per kind (None: that kind is
    given whole); the step passes it with the distinct pixels, so that any path can expand them back."""

    image_rows: torch.Tensor | None = None  # int64 [image pixel rows, one entry per placeholder]
    video_rows: torch.Tensor | None = None  # int64 [video pixel rows, one entry per placeholder]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> VisionSources:
        """The same sources with every tensor on `device`."""
        return _tensors_mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> VisionSources:
        """Page-locked copies, so `to(cuda, non_blocking=True)` overlaps."""
        return _tensors_mapped(self, torch.Tensor.pin_memory)

    def expanded(
        self, pixel_values: torch.Tensor | None, pixel_values_videos: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pixels with one entry per placeholder, as the loader's batch has them (a gather on the device)."""
        return _gathered(pixel_values, self.image_rows), _gathered(pixel_values_videos, self.video_rows)


def _gathered(rows: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    return rows if rows is None or index is None else rows.index_select(0, index)


@dataclass(kw_only=True, slots=True)
class DistinctVision:
    """One kind's distinct images (or videos) of a micro-batch, for a forward that encodes each once: the grid the
    tower is given and, for each placeholder feature row, its row in the tower's output."""

    grid_thw: torch.Tensor  # [distinct, 3]
    patches: int  # the pixel rows of the distinct grid (what the tower must be given)
    feature_rows: torch.Tensor  # int64 [features, one entry per placeholder]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> DistinctVision:
        """The same with every tensor on `device`."""
        return _tensors_mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> DistinctVision:
        """Page-locked copies, so `to(cuda, non_blocking=True)` overlaps."""
        return _tensors_mapped(self, torch.Tensor.pin_memory)

    def features(self, output: torch.Tensor) -> torch.Tensor:
        """The tower's output rows [distinct features, hidden] given to every placeholder [features, hidden]."""
        return output.index_select(0, self.feature_rows)


def distinct_vision(sources: torch.Tensor, grid_thw: torch.Tensor, merged: int) -> DistinctVision:
    """The `DistinctVision` of one kind (host tensors): `sources` its items' distinct indices, `grid_thw` their grids
    (one per placeholder item), `merged` the patches per feature row (spatial_merge_size**2)."""
    first = first_occurrences(sources)
    grid = grid_thw.reshape(-1, 3)[first]
    _, feature_rows = distinct_rows(sources, grid_thw.reshape(-1, 3).prod(-1) // merged)
    return DistinctVision(grid_thw=grid, patches=int(grid.prod(-1).sum()), feature_rows=feature_rows)
