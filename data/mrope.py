"""Qwen-VL 3-D multimodal RoPE position ids (temporal, height, width) for one sub-sequence, in numpy.

Follows transformers 5.12 `get_rope_index` of Qwen2-VL, Qwen2.5-VL (temporal spacing from
`second_per_grid_ts` x `tokens_per_second`) and Qwen3-VL (each video frame is its own t=1 grid, separated by
timestamp text): text runs count up by one; a vision run takes (t, h, w) grid positions offset by the running
position, which then advances by max(h, w) / merge. Packed sub-sequences each start again at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qvl.foundation.families import get_family


@dataclass(kw_only=True, slots=True, frozen=True)
class RopeConfig:
    """What position ids depend on besides the tokens."""

    family: str
    spatial_merge_size: int
    image_pad_id: int
    video_pad_id: int
    tokens_per_second: int | None = None  # Qwen2.5-VL only: the model config's vision_config.tokens_per_second


def _vision_positions(start: int, grid: tuple[int, int, int], merge: int, time_interval: int) -> np.ndarray:
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    temporal = np.repeat(np.arange(t) * time_interval, h * w) + start
    height = np.tile(np.repeat(np.arange(h), w), t) + start
    width = np.tile(np.arange(w), h * t) + start
    return np.stack([temporal, height, width])


def mrope_position_ids(
    ids: np.ndarray,
    image_grids: list,
    video_grids: list,
    config: RopeConfig,
    second_per_grid_ts: list[float] | None = None,
) -> np.ndarray:
    """Position ids [3, len(ids)] of one (unpacked) sample."""
    ids = np.asarray(ids)
    kinds = np.zeros(len(ids), dtype=np.int8)
    kinds[ids == config.image_pad_id] = 1
    kinds[ids == config.video_pad_id] = 2
    if get_family(
        config.family
    ).video_frames_timestamped:  # one t=1 grid per frame: frames are split by timestamps in the text
        video_grids = [(1, g[1], g[2]) for g in video_grids for _ in range(int(g[0]))]
    grids = {1: iter(image_grids), 2: iter(video_grids)}
    seconds = iter(second_per_grid_ts or [])
    boundaries = np.flatnonzero(np.diff(kinds)) + 1
    starts = np.r_[0, boundaries]
    ends = np.r_[boundaries, len(ids)]
    out, position = [], 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        kind = int(kinds[start])
        if kind == 0:
            out.append(np.broadcast_to(np.arange(end - start) + position, (3, end - start)))
            position += end - start
            continue
        grid = next(grids[kind])
        interval = 1
        if kind == 2 and get_family(config.family).video_positions_in_seconds:
            if config.tokens_per_second is None:
                raise ValueError("Qwen2.5-VL video positions need tokens_per_second from the model's vision_config")
            interval = config.tokens_per_second * int(next(seconds, 1))  # int(): same truncation as transformers
        block = _vision_positions(position, grid, config.spatial_merge_size, interval)
        if block.shape[1] != end - start:
            raise ValueError(f"vision run of {end - start} tokens does not match grid {tuple(grid)}")
        out.append(block)
        position += max(int(grid[1]), int(grid[2])) // config.spatial_merge_size
    return np.concatenate(out, axis=1) if out else np.zeros((3, 0), dtype=np.int64)


def packed_position_ids(sub_ids: list[np.ndarray], sub_media: list[dict], config: RopeConfig) -> np.ndarray:
    """Position ids [3, T] of a pack: each sub-sequence restarts at 0."""
    blocks = [
        mrope_position_ids(
            ids, media["image_grid_thw"], media["video_grid_thw"], config, media.get("second_per_grid_ts")
        )
        for ids, media in zip(sub_ids, sub_media, strict=True)
    ]
    return np.concatenate(blocks, axis=1) if blocks else np.zeros((3, 0), dtype=np.int64)
