"""Pack: offline best-fit-decreasing bin packing of token lengths into sequences of `seq_length`, in numpy.

Items of equal length are interchangeable, and best fit places a run of equal items into the tightest bin
until it can take no more, then the next tightest. So the packer works on *groups of identical bins* per
distinct length (a few thousand at most) instead of per item, and only at the end maps sample indices onto
the slots with one stable sort. The result equals per-item best-fit decreasing (tests check that) at well over
a million samples per second on one core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True, slots=True)
class PackPlan:
    """Which items go in which pack: `order[offsets[k]:offsets[k+1]]` are the item positions of pack k.

    `columns` holds extra per-pack arrays written as fields of packs.jsonl (e.g. "cost", "step", "rank"), so a
    later planner can annotate a plan without changing its shape.
    """

    order: np.ndarray  # int64 [n_items]
    offsets: np.ndarray  # int64 [n_packs + 1]
    seq_length: int
    columns: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_packs(self) -> int:
        return len(self.offsets) - 1

    def pack(self, k: int) -> np.ndarray:
        """Item positions of pack k."""
        return self.order[self.offsets[k] : self.offsets[k + 1]]

    def pack_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens in each pack."""
        sums = np.add.reduceat(np.asarray(lengths)[self.order], self.offsets[:-1]) if len(self.order) else np.zeros(0)
        return sums.astype(np.int64)

    def reordered(self, packs: np.ndarray) -> PackPlan:
        """The same packs in a new order: pack `packs[k]` becomes pack k (columns follow)."""
        sizes = np.diff(self.offsets)[packs]
        offsets = np.zeros(len(packs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        starts = np.repeat(self.offsets[:-1][packs] - offsets[:-1], sizes)
        order = self.order[starts + np.arange(offsets[-1])]
        columns = {name: column[packs] for name, column in self.columns.items()}
        return PackPlan(order=order, offsets=offsets, seq_length=self.seq_length, columns=columns)

    def efficiency(self, lengths: np.ndarray) -> float:
        """Real tokens / (packs x seq_length)."""
        return float(np.sum(lengths)) / (self.n_packs * self.seq_length) if self.n_packs else 0.0


def _check_lengths(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be positive")
    if lengths.size and (lengths.min() < 1 or lengths.max() > seq_length):
        too_long = int((lengths > seq_length).sum())
        raise ValueError(
            f"{too_long} item(s) are longer than seq_length={seq_length} (max {int(lengths.max())}) and "
            f"{int((lengths < 1).sum())} are empty; quarantine or truncate them before packing"
        )
    return lengths


def pack_best_fit_decreasing(lengths: np.ndarray, seq_length: int) -> PackPlan:
    """Best-fit-decreasing packing of `lengths` into bins of `seq_length`; deterministic for equal input."""
    lengths = _check_lengths(lengths, seq_length)
    if lengths.size == 0:
        return PackPlan(order=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64), seq_length=seq_length)
    values, counts = np.unique(lengths, return_counts=True)
    bins = _BinGroups(seq_length)
    for length, count in zip(values[::-1].tolist(), counts[::-1].tolist()):
        bins.place(length, count)
    slot_bin, slot_len = bins.slots()
    return _assign(lengths, slot_bin, slot_len, seq_length)


class _BinGroups:
    """Open bins as groups of identical bins (same content) per remaining capacity."""

    def __init__(self, seq_length: int):
        self.seq_length = seq_length
        self.levels: dict[int, list[list[int]]] = {}  # capacity -> FIFO of [n_bins, content_id]
        self.bin_count = np.zeros(seq_length + 1, dtype=np.int64)  # bins per remaining capacity
        self.contents: list[tuple[int, int, int]] = []  # content_id -> (parent content_id, length, n_items)

    def _add(self, capacity: int, n_bins: int, parent: int, length: int, n_items: int) -> None:
        self.contents.append((parent, length, n_items))
        self.levels.setdefault(capacity, []).append([n_bins, len(self.contents) - 1])
        self.bin_count[capacity] += n_bins

    def place(self, length: int, count: int) -> None:
        """Place `count` items of `length` exactly as per-item best fit would."""
        capacities = length + np.flatnonzero(self.bin_count[length:])
        per_bin = capacities // length
        absorbed = np.cumsum(self.bin_count[capacities] * per_bin)
        full_levels = int(np.searchsorted(absorbed, count, side="left"))
        for capacity, q in zip(capacities[:full_levels].tolist(), per_bin[:full_levels].tolist()):
            self._fill_level(capacity, length, q)
        placed = int(absorbed[full_levels - 1]) if full_levels else 0
        if full_levels < len(capacities) and count > placed:
            self._fill_level_partly(int(capacities[full_levels]), length, int(per_bin[full_levels]), count - placed)
        elif count > placed:
            self._open_bins(length, count - placed)

    def _fill_level(self, capacity: int, length: int, q: int) -> None:
        groups = self.levels.pop(capacity)
        self.bin_count[capacity] = 0
        for n_bins, content in groups:
            self._add(capacity - q * length, n_bins, content, length, q)

    def _fill_level_partly(self, capacity: int, length: int, q: int, items: int) -> None:
        groups = self.levels[capacity]
        full_bins, rest = divmod(items, q)
        while full_bins or rest:
            n_bins, content = groups[0]
            take = min(n_bins, full_bins)
            if take:
                self._add(capacity - q * length, take, content, length, q)
                full_bins -= take
            elif rest:
                self._add(capacity - rest * length, 1, content, length, rest)
                take, rest = 1, 0
            self.bin_count[capacity] -= take
            if take == n_bins:
                groups.pop(0)
            else:
                groups[0][0] -= take
        if not groups:
            del self.levels[capacity]

    def _open_bins(self, length: int, items: int) -> None:
        q = self.seq_length // length
        full_bins, rest = divmod(items, q)
        if full_bins:
            self._add(self.seq_length - q * length, full_bins, -1, length, q)
        if rest:
            self._add(self.seq_length - rest * length, 1, -1, length, rest)

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(bin id, item length) per slot, grouped by bin; fullest bins first."""
        memo: dict[int, np.ndarray] = {}
        bins_per_group, group_items = [], []
        for capacity in sorted(self.levels):
            for n_bins, content in self.levels[capacity]:
                bins_per_group.append(n_bins)
                group_items.append(self._items(content, memo))
        sizes = np.asarray([len(items) for items in group_items], dtype=np.int64)
        n_bins = np.asarray(bins_per_group, dtype=np.int64)
        slot_len = np.concatenate([np.tile(items, n) for items, n in zip(group_items, bins_per_group)])
        slot_bin = np.repeat(np.arange(int(n_bins.sum())), np.repeat(sizes, n_bins))
        return slot_bin, slot_len

    def _items(self, content: int, memo: dict[int, np.ndarray]) -> np.ndarray:
        if content in memo:
            return memo[content]
        chain = []
        node = content
        while node != -1 and node not in memo:
            chain.append(node)
            node = self.contents[node][0]
        items = memo.get(node, np.zeros(0, np.int64))
        for node in reversed(chain):
            _, length, n_items = self.contents[node]
            items = np.concatenate([items, np.full(n_items, length, np.int64)])
            memo[node] = items
        return items


def _stable_order_by_length_desc(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    key = seq_length - lengths
    # A 16-bit key lets numpy use radix sort: linear time for millions of items.
    key = key.astype(np.uint16) if seq_length < 1 << 16 else key
    return np.argsort(key, kind="stable")


def _assign(lengths: np.ndarray, slot_bin: np.ndarray, slot_len: np.ndarray, seq_length: int) -> PackPlan:
    """Map items (longest first, ties by index) onto slots (longest first, ties by bin)."""
    items_by_length = _stable_order_by_length_desc(lengths, seq_length)
    slots_by_length = _stable_order_by_length_desc(slot_len, seq_length)
    order = np.empty(len(lengths), dtype=np.int64)
    order[slots_by_length] = items_by_length
    offsets = np.zeros(int(slot_bin[-1]) + 2, dtype=np.int64)
    np.cumsum(np.bincount(slot_bin), out=offsets[1:])
    return PackPlan(order=order, offsets=offsets, seq_length=seq_length)


def pack_next_fit(lengths: np.ndarray, seq_length: int) -> PackPlan:
    """Online next-fit in input order (the baseline an online packer gets): one open bin at a time."""
    lengths = _check_lengths(lengths, seq_length)
    starts, fill = [0], 0
    for position, length in enumerate(lengths.tolist()):
        if fill + length > seq_length:
            starts.append(position)
            fill = 0
        fill += length
    offsets = np.asarray(starts + [len(lengths)], dtype=np.int64) if len(lengths) else np.zeros(1, np.int64)
    return PackPlan(order=np.arange(len(lengths), dtype=np.int64), offsets=offsets, seq_length=seq_length)


def pack_padded(lengths: np.ndarray, seq_length: int) -> PackPlan:
    """No packing: every item padded to its own sequence."""
    lengths = _check_lengths(lengths, seq_length)
    return PackPlan(
        order=np.arange(len(lengths), dtype=np.int64),
        offsets=np.arange(len(lengths) + 1, dtype=np.int64),
        seq_length=seq_length,
    )


def balance_by_cost(plan: PackPlan, lengths: np.ndarray, costs: np.ndarray, passes: int = 2) -> PackPlan:
    """Even out pack costs by swapping equal-length items between packs (token fill stays exactly the same).

    Per distinct length, the items are dealt costliest first in a snake order over the packs holding that
    length, cheapest pack (without those items) first, so expensive samples spread over cheap packs.
    """
    lengths, costs = np.asarray(lengths), np.asarray(costs, dtype=np.float64)
    order = plan.order.copy()
    slot_pack = np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets))
    slot_len = lengths[order]
    by_length = np.argsort(slot_len, kind="stable")
    bounds = np.flatnonzero(np.diff(slot_len[by_length])) + 1
    groups = [g for g in np.split(by_length, bounds) if len(g) > 1]
    # Rank of each slot among the same-length slots of its pack (slots of a pack are contiguous).
    rank = np.zeros(len(order), dtype=np.int64)
    for slots in groups:
        first = np.r_[True, slot_pack[slots][1:] != slot_pack[slots][:-1]]
        starts = np.maximum.accumulate(np.where(first, np.arange(len(slots)), 0))
        rank[slots] = np.arange(len(slots)) - starts
    for _ in range(passes):
        pack_cost = np.bincount(slot_pack, weights=costs[order], minlength=plan.n_packs)
        for slots in groups:
            items = order[slots]
            packs = slot_pack[slots]
            base = pack_cost[packs] - np.bincount(packs, weights=costs[items], minlength=plan.n_packs)[packs]
            direction = np.where(rank[slots] % 2 == 0, 1.0, -1.0)
            dealt = slots[np.lexsort((direction * base, rank[slots]))]
            new_items = items[np.argsort(-costs[items], kind="stable")]
            np.subtract.at(pack_cost, packs, costs[items])
            order[dealt] = new_items
            np.add.at(pack_cost, slot_pack[dealt], costs[new_items])
    return PackPlan(order=order, offsets=plan.offsets.copy(), seq_length=plan.seq_length, columns=dict(plan.columns))
