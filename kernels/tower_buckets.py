"""The fixed shapes a graphed vision tower call is padded into (qvl.kernels.tower_graphs): its bucket's pixel rows,
attention blocks and windows; and the bucket sizes planned from a prepared dataset's tower calls.

A CUDA graph replays fixed shapes and every micro-batch has its own patch count, so a call is padded up to a bucket.
Without a plan a bucket is the call's rows rounded up on a geometric grid (`tower_bucket`: eight sizes per doubling,
at most 1/8 more rows). Offline packing knows every call before training starts (`qvl data prepare` writes each
pack's tower rows into packs.jsonl), so the sizes can instead be chosen to pad that dataset's calls least
(`planned_sizes`: at most one graph per size, every call fits the smallest size at or above it).

The blocks and windows of a bucket are slots: `cu_seqlens` and `cu_window_seqlens` rounded up (to BLOCK_SLOTS and
WINDOW_SLOTS), their extra entries empty. So is its longest block, the `max_seqlen` its attention kernels are
launched with (a flash kernel's grid has a row of programs per `max_seqlen` rows for every block, most of which
return at once): the call's longest image or frame rounded up (to LONGEST_SLOTS), not the bucket's rows; the pad rows
are then blocks of at most that many. None of them makes buckets of its own: a call of a size whose graph has too few
slots grows that size's graph (`TowerBucket.grown`: at least twice the slots), so a size has one graph.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_GRAPHS = 16  # bucket sizes captured per tower; a call of another size runs eagerly
BUCKETS_PER_DOUBLING = 8  # patch counts per octave: a bucket holds at most 1/8 more rows than its calls
BLOCK_SLOTS = 16  # cu_seqlens' blocks rounded up to a multiple of this
WINDOW_SLOTS = 128  # cu_window_seqlens' windows rounded up to a multiple of this
LONGEST_SLOTS = 256  # a graph's longest attention block (max_seqlen) rounded up to a multiple of this
PLANNED_VALUES = 2048  # distinct call sizes the plan weighs; more are first put on a 128-per-doubling grid


@dataclass(kw_only=True, slots=True, frozen=True)
class TowerBucket:
    """The fixed shapes of one tower graph: pixel rows, full-attention blocks, windows (0 without windows), and the
    longest full-attention block (the kernels' `max_seqlen`)."""

    patches: int
    blocks: int
    windows: int
    longest: int

    def holds(self, other: TowerBucket) -> bool:
        """Whether a call that needs `other` (the same rows) fits this bucket's slots."""
        return self.blocks >= other.blocks and self.windows >= other.windows and self.longest >= other.longest

    def grown(self, needed: TowerBucket) -> TowerBucket:
        """This bucket's rows with slots for `needed` too: a slot count that is short at least doubles, so a size's
        graph is made again a few times at most."""
        return TowerBucket(
            patches=self.patches,
            blocks=_grown(self.blocks, needed.blocks),
            windows=_grown(self.windows, needed.windows),
            longest=min(_grown(self.longest, needed.longest), self.patches),
        )


def _grown(have: int, need: int) -> int:
    return have if need <= have else max(need, 2 * have)


def tower_unit(vision_config: Any) -> tuple[int, int | None]:
    """(unit, window): the rows a graphed call's bucket of a tower with `vision_config` is a multiple of (a merge
    unit, or a whole window where it windows its attention, Qwen2.5-VL), and the rows of one window (None)."""
    merge_unit = vision_config.spatial_merge_size**2
    window_size = getattr(vision_config, "window_size", None)
    window = None if window_size is None else (window_size // vision_config.patch_size) ** 2
    return (merge_unit if window is None else window), window


def planned_padding(call_rows: Iterable[int], *, unit: int, most: int = MAX_GRAPHS) -> float:
    """The rows the sizes planned for `call_rows` (at most `most`) add, as a share of the calls' rows."""
    calls = list(call_rows)
    return padding_share(calls, planned_sizes(calls, unit=unit, most=most), unit=unit)


def tower_bucket(
    patches: int,
    blocks: int,
    windows: int | None,
    *,
    unit: int,
    window: int | None,
    longest: int,
    sizes: tuple[int, ...] = (),
) -> TowerBucket:
    """The bucket of a call of `patches` rows in `blocks` blocks, the longest of `longest` rows, and `windows` windows
    (None: a tower without windowed attention). `unit`: the rows a bucket's size is a multiple of (a merge unit, or a
    whole window); `window`: the rows of one window; `sizes`: the planned sizes, ascending (`planned_sizes`): the
    smallest that holds the call, the geometric grid for a call above them all. The pad rows take blocks of at most
    the bucket's longest (at least one block) and whole windows."""
    rows = bucket_size(patches, unit=unit, sizes=sizes)
    pad = rows - patches
    longest = min(_round_up(max(longest, 1), LONGEST_SLOTS), rows)
    padded_windows = 0
    if windows is not None:
        padded_windows = _round_up(windows + math.ceil(pad / window), WINDOW_SLOTS)
    pad_blocks = max(1, math.ceil(pad / longest))
    return TowerBucket(
        patches=rows, blocks=_round_up(blocks + pad_blocks, BLOCK_SLOTS), windows=padded_windows, longest=longest
    )


def bucket_size(
    patches: int, *, unit: int, sizes: tuple[int, ...] = (), per_doubling: int = BUCKETS_PER_DOUBLING
) -> int:
    """The pixel rows of the bucket of a call of `patches` rows: the smallest of `sizes` that holds it, else the
    geometric grid's (`per_doubling` sizes per doubling, multiples of `unit`)."""
    if patches < 1:
        raise ValueError(f"a tower call of {patches} pixel rows has no bucket; call the tower with pixels")
    index = bisect.bisect_left(sizes, patches)  # a host int per tower call: no array
    if index < len(sizes):
        return int(sizes[index])
    granule = max(unit, 1 << max(0, patches.bit_length() - 1 - int(math.log2(per_doubling))))
    granule = unit * math.ceil(granule / unit)
    return granule * math.ceil(patches / granule)


def planned_sizes(call_rows: Iterable[int], *, unit: int, most: int) -> tuple[int, ...]:
    """At most `most` bucket sizes (ascending multiples of `unit`) that add the fewest pad rows to the calls
    `call_rows` (one entry per tower call of the dataset; zeros are packs without such media), each call in the
    smallest size that holds it; () for no calls. The largest size is the largest call's rows rounded up to `unit`.

    Exact over the calls' distinct sizes (rounded up to `unit`): the least total rows of the first j sizes in m
    buckets, the last of them size j, is the least over i < j of the first i sizes in m - 1 buckets plus size j for
    the calls between (a dynamic programme, O(most x n^2) for n distinct sizes; more than PLANNED_VALUES are first
    put on a 128-per-doubling grid, at most 1/128 more rows)."""
    rows = np.asarray(list(call_rows), dtype=np.int64)
    rows = rows[rows > 0]
    if not len(rows) or most < 1:
        return ()
    values, counts = np.unique(unit * -(-rows // unit), return_counts=True)
    if len(values) > PLANNED_VALUES:
        fine = [bucket_size(int(v), unit=unit, per_doubling=128) for v in values]
        values, inverse = np.unique(fine, return_inverse=True)
        counts = np.bincount(inverse, weights=counts).astype(np.int64)
    n = len(values)
    below = np.concatenate([[0], np.cumsum(counts)])  # below[j]: calls of the first j sizes
    total = values * below[1:]  # one bucket of size j holds the first j + 1 sizes
    choices = []  # per extra bucket: for each j, the last size of the buckets before size j's (-1: none better)
    for _ in range(1, min(most, n)):
        better, choice = total.copy(), np.full(n, -1)
        for j in range(1, n):
            options = total[:j] + values[j] * (below[j + 1] - below[1 : j + 1])
            i = int(np.argmin(options))
            if options[i] < better[j]:
                better[j], choice[j] = options[i], i
        total = better
        choices.append(choice)
    sizes, j = [int(values[-1])], n - 1
    for choice in reversed(choices):
        if choice[j] >= 0:
            j = int(choice[j])
            sizes.append(int(values[j]))
    return tuple(sorted(sizes))


def padding_share(call_rows: Iterable[int], sizes: tuple[int, ...], *, unit: int) -> float:
    """The rows the buckets add, as a share of the calls' real rows (0 for no calls)."""
    rows = np.asarray(list(call_rows), dtype=np.int64)
    rows = rows[rows > 0]
    if not len(rows):
        return 0.0
    index = np.searchsorted(np.asarray(sizes, dtype=np.int64), rows)  # a dataset's calls: vectorised
    held = index < len(sizes)
    padded = int(np.asarray(sizes, dtype=np.int64)[index[held]].sum()) if held.any() else 0
    padded += sum(bucket_size(int(r), unit=unit) for r in rows[~held])  # above every size: the grid
    return padded / int(rows.sum()) - 1


def _round_up(value: int, multiple: int) -> int:
    return multiple * math.ceil(value / multiple)
