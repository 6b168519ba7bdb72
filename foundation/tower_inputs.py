"""What a replicated HF vision tower (Qwen2-VL, Qwen2.5-VL) derives from `grid_thw`, computed on the host once.

transformers 5.12 lets a caller hand a vision tower these values precomputed: each `get_vision_*` helper in
transformers/vision_utils.py pops its key (`position_ids`, `cu_seqlens`, `window_index`, `cu_window_seqlens`) from
the forward's kwargs before computing it. A tower that computes them itself from a CUDA `grid_thw` reads the grid
back to the host (`.tolist()`, twice per call) and loops over images in Python; its attention then turns each block's
`max_seqlen` tensor into an int (a host sync in every block). Computed here from a CPU `grid_thw` with the same
transformers functions, they cost no device sync, and the maximum lengths are Python ints. The loader computes them
in its worker processes; `qvl.bridges.lean_vision` hands them to the tower.
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
        moved = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def pin_memory(self) -> TowerInputs:
        """Page-locked copies, so `to(cuda, non_blocking=True)` really overlaps (DataLoader's pin_memory calls this)."""
        pinned = {
            f.name: value.pin_memory() for f in fields(self) if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **pinned)

    def max_seqlens(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """(cu_seqlens tensor, its longest block) pairs, for an attention function handed one of these tensors."""
        pairs = [(self.cu_seqlens, self.max_seqlen)]
        if self.cu_window_seqlens is not None:
            pairs.append((self.cu_window_seqlens, self.max_window_seqlen))
        return tuple(pairs)


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


def tower_inputs_for_config(grid_thw: torch.Tensor, vision_config: Any) -> TowerInputs:
    """`tower_inputs` with the settings of an HF vision config (an object or its config.json dict)."""
    get = vision_config.get if isinstance(vision_config, dict) else lambda name: getattr(vision_config, name, None)
    window_size = get("window_size")  # Qwen2.5-VL windows its attention; Qwen2-VL's config has no window_size
    return tower_inputs(
        grid_thw,
        spatial_merge_size=int(get("spatial_merge_size")),
        patch_size=int(get("patch_size")),
        window_size=None if window_size is None else int(window_size),
    )
