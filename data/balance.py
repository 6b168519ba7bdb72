"""Balance: a data-parallel-aware schedule of packed sequences, so every rank of every step gets the same compute.

Megatron-Core's `dp_balanced` evens out token counts; the slowest rank still sets the step time when packs of
equal tokens carry unequal vision and attention work (OrchMLLM, arXiv 2503.23830: "modality composition
incoherence"). `plan_dp_balanced` takes each pack's cost (`qvl.foundation.cost`) and

1. deals the packs, costliest first, to the steps in snake order, so every step gets one pack from each cost
   stratum and all steps carry about the same work;
2. inside each step, assigns packs in rounds of D, the costliest of a round to the least loaded rank, so every
   rank gets exactly G/D packs (largest-first greedy under a cardinality constraint);
3. refines: repeatedly swaps one pack of the heaviest rank with one of another rank of the same step when that
   lowers the heavier of the two the most.

Every stage is numpy over all steps at once. The steps' time order is a seeded shuffle, so training does not
see the costliest packs first. A last partial global batch (n_packs not a multiple of G) is left unscheduled
(step = rank = -1), as Megatron's sampler drops an incomplete global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(kw_only=True, slots=True, frozen=True)
class DPPlan:
    """Where each pack runs: `step`, `rank` and `slot` (its place among the rank's packs of that step)."""

    step: np.ndarray  # int64 [n_packs]; -1 = not scheduled
    rank: np.ndarray  # int64 [n_packs]; -1 = not scheduled
    slot: np.ndarray  # int64 [n_packs]; 0 .. G/D - 1; -1 = not scheduled
    data_parallel: int
    global_batch_size: int

    @property
    def n_steps(self) -> int:
        return int(self.step.max()) + 1 if len(self.step) and self.step.max() >= 0 else 0

    def rank_costs(self, cost: np.ndarray) -> np.ndarray:
        """[n_steps, D] summed cost per step and rank."""
        scheduled = self.step >= 0
        flat = self.step[scheduled] * self.data_parallel + self.rank[scheduled]
        sums = np.bincount(
            flat, weights=np.asarray(cost, np.float64)[scheduled], minlength=self.n_steps * self.data_parallel
        )
        return sums.reshape(self.n_steps, self.data_parallel)

    def packs_of_rank(self, rank: int) -> np.ndarray:
        """The pack ids that `rank` serves, in order (step by step, slot by slot)."""
        mine = np.flatnonzero(self.rank == rank)
        return mine[np.lexsort((self.slot[mine], self.step[mine]))]


def imbalance(plan: DPPlan, cost: np.ndarray) -> dict:
    """Max/mean rank cost per step: its mean and worst over steps, and sum of step maxima / sum of step means.

    The last figure is the slowdown a synchronous step pays for imbalance: steps take as long as their slowest rank.
    """
    loads = plan.rank_costs(cost)
    if loads.size == 0:
        return {"steps": 0, "mean_max_over_mean": 1.0, "worst_max_over_mean": 1.0, "time_over_ideal": 1.0}
    mean = loads.mean(axis=1)
    ratio = np.divide(loads.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
    return {
        "steps": int(len(loads)),
        "mean_max_over_mean": round(float(ratio.mean()), 5),
        "worst_max_over_mean": round(float(ratio.max()), 5),
        "time_over_ideal": round(float(loads.max(axis=1).sum() / max(mean.sum(), 1e-300)), 5),
    }


def check_global_batch(n_packs: int, data_parallel: int, global_batch_size: int) -> int:
    """The number of whole global batches in `n_packs`; fails if ranks cannot take equal shares."""
    if data_parallel < 1 or global_batch_size < 1 or global_batch_size % data_parallel:
        raise ValueError(
            f"--global-batch-size {global_batch_size} must be a positive multiple of --data-parallel "
            f"{data_parallel} (each rank takes global_batch_size / data_parallel packs per step)"
        )
    return n_packs // global_batch_size


def _unscheduled(n_packs: int, data_parallel: int, global_batch_size: int) -> DPPlan:
    minus = np.full(n_packs, -1, dtype=np.int64)
    return DPPlan(
        step=minus,
        rank=minus.copy(),
        slot=minus.copy(),
        data_parallel=data_parallel,
        global_batch_size=global_batch_size,
    )


def _chosen(n_packs: int, n_steps: int, global_batch_size: int, seed: int) -> np.ndarray:
    """The packs that fit into whole global batches; a seeded pick of which ones wait, so no cost class is favoured."""
    keep = n_steps * global_batch_size
    if keep == n_packs:
        return np.arange(n_packs)
    return np.sort(np.random.default_rng(seed).permutation(n_packs)[:keep])


def plan_round_robin(n_packs: int, data_parallel: int, global_batch_size: int) -> DPPlan:
    """The naive schedule: packs in file order, G per step, dealt round-robin over the ranks."""
    n_steps = check_global_batch(n_packs, data_parallel, global_batch_size)
    plan = _unscheduled(n_packs, data_parallel, global_batch_size)
    k = np.arange(n_steps * global_batch_size)
    plan.step[k], plan.rank[k], plan.slot[k] = (
        k // global_batch_size,
        k % data_parallel,
        (k % global_batch_size) // data_parallel,
    )
    return plan


def plan_random(n_packs: int, data_parallel: int, global_batch_size: int, seed: int = 0) -> DPPlan:
    """A shuffled round-robin schedule (what a shuffling loader gives)."""
    n_steps = check_global_batch(n_packs, data_parallel, global_batch_size)
    plan = _unscheduled(n_packs, data_parallel, global_batch_size)
    k = np.arange(n_steps * global_batch_size)
    packs = np.random.default_rng(seed).permutation(n_packs)[: len(k)]
    plan.step[packs], plan.rank[packs] = k // global_batch_size, k % data_parallel
    plan.slot[packs] = (k % global_batch_size) // data_parallel
    return plan


def plan_dp_balanced(
    cost: np.ndarray, data_parallel: int, global_batch_size: int, *, seed: int = 0, refine_passes: int = 64
) -> DPPlan:
    """Schedule packs into steps of `global_batch_size` and ranks of `data_parallel` with balanced per-rank cost."""
    cost = np.asarray(cost, dtype=np.float64)
    n_steps = check_global_batch(len(cost), data_parallel, global_batch_size)
    plan = _unscheduled(len(cost), data_parallel, global_batch_size)
    if n_steps == 0:
        return plan
    chosen = _chosen(len(cost), n_steps, global_batch_size, seed)
    step_packs = _deal_to_steps(chosen, cost[chosen], n_steps, global_batch_size)  # [S, G], costliest first per step
    rank_of = _assign_ranks(cost[step_packs], data_parallel)  # [S, G]
    rank_of = _refine(cost[step_packs], rank_of, data_parallel, refine_passes)
    time_order = np.random.default_rng(seed).permutation(n_steps)
    steps = np.broadcast_to(time_order[:, None], step_packs.shape)
    # Slot: place among the rank's packs of the step, costliest first.
    order = np.lexsort((np.broadcast_to(np.arange(global_batch_size), step_packs.shape), rank_of), axis=1)
    slot = np.empty_like(rank_of)
    np.put_along_axis(
        slot, order, np.tile(np.arange(global_batch_size) % (global_batch_size // data_parallel), (n_steps, 1)), axis=1
    )
    plan.step[step_packs], plan.rank[step_packs], plan.slot[step_packs] = steps, rank_of, slot
    return plan


def _deal_to_steps(packs: np.ndarray, cost: np.ndarray, n_steps: int, global_batch_size: int) -> np.ndarray:
    """[S, G] pack ids: the i-th costliest pack goes to step i mod S, in snake order by stratum."""
    by_cost = packs[np.lexsort((packs, -cost))].reshape(global_batch_size, n_steps)  # stratum x step
    by_cost[1::2] = by_cost[1::2, ::-1]  # snake: odd strata run from the last step back
    return np.ascontiguousarray(by_cost.T)


def _assign_ranks(cost: np.ndarray, data_parallel: int) -> np.ndarray:
    """Per step, rounds of D packs (costliest first), each pack of a round to a different rank, lightest first."""
    n_steps, global_batch_size = cost.shape
    rows = np.arange(n_steps)[:, None]
    loads = np.zeros((n_steps, data_parallel))
    rank_of = np.empty((n_steps, global_batch_size), dtype=np.int64)
    for start in range(0, global_batch_size, data_parallel):
        lightest_first = np.argsort(loads, axis=1, kind="stable")
        rank_of[:, start : start + data_parallel] = lightest_first
        loads[rows, lightest_first] += cost[:, start : start + data_parallel]
    return rank_of


def _refine(cost: np.ndarray, rank_of: np.ndarray, data_parallel: int, passes: int) -> np.ndarray:
    """Swap a pack of each step's heaviest rank with a pack of another rank where it lowers that pair's maximum."""
    n_steps, global_batch_size = cost.shape
    per_rank = global_batch_size // data_parallel
    if per_rank == 0 or data_parallel == 1:
        return rank_of
    # Positions of each rank's packs within the step: [S, D, m].
    by_rank = np.argsort(rank_of, axis=1, kind="stable").reshape(n_steps, data_parallel, per_rank)
    chunk = max(
        1, _REFINE_ELEMENTS // (_partners(data_parallel, per_rank) * per_rank * per_rank + global_batch_size)
    )  # bounds the [s, D, m, m] temporaries
    for start in range(0, n_steps, chunk):
        part = slice(start, min(start + chunk, n_steps))
        by_rank[part] = _refine_steps(cost[part], by_rank[part], passes)
    out = np.empty_like(rank_of)
    np.put_along_axis(
        out,
        by_rank.reshape(n_steps, -1),
        np.broadcast_to(np.repeat(np.arange(data_parallel), per_rank), (n_steps, global_batch_size)),
        axis=1,
    )
    return out


_REFINE_ELEMENTS = 1 << 21
_SWAPS_PER_STEP = 4096  # candidate swaps per step and pass


def _partners(data_parallel: int, per_rank: int) -> int:
    """How many of the lightest ranks to try swapping with: all when packs per rank are few, else the lightest."""
    return max(1, min(data_parallel - 1, _SWAPS_PER_STEP // (per_rank * per_rank)))


def _refine_steps(cost: np.ndarray, by_rank: np.ndarray, passes: int) -> np.ndarray:
    """`_refine` on a chunk of steps; steps drop out once no swap helps."""
    n_steps, data_parallel, per_rank = by_rank.shape
    active = np.arange(n_steps)
    for _ in range(passes):
        held = np.take_along_axis(cost[active], by_rank[active].reshape(len(active), -1), axis=1)
        held = held.reshape(len(active), data_parallel, per_rank)
        loads = held.sum(axis=2)
        rows = np.arange(len(active))
        heavy = loads.argmax(axis=1)
        top = loads[rows, heavy]
        # Partners: the lightest ranks, where a swap can take the most off the heavy one.
        partners = np.argsort(loads, axis=1, kind="stable")[:, : _partners(data_parallel, per_rank)]
        held_p = held[rows[:, None], partners]  # [s, K, m]
        # delta[s, k, i, j]: the heavy rank's pack i for partner k's pack j lowers the heavy rank by delta.
        delta = held[rows, heavy][:, None, :, None] - held_p[:, :, None, :]
        load_p = loads[rows[:, None], partners]
        pair_max = np.maximum(top[:, None, None, None] - delta, load_p[:, :, None, None] + delta)
        flat = pair_max.reshape(len(active), -1).argmin(axis=1)
        better = pair_max.reshape(len(active), -1)[rows, flat] < top * (1 - 1e-12)
        if not better.any():
            break
        s, h = active[better], heavy[better]
        k, i, j = np.unravel_index(flat[better], held_p.shape[1:] + (per_rank,))
        r = partners[rows[better], k]
        out_of_heavy, into_heavy = by_rank[s, h, i].copy(), by_rank[s, r, j].copy()
        by_rank[s, h, i], by_rank[s, r, j] = into_heavy, out_of_heavy
        active = s
    return by_rank


def schedule_order(plan: DPPlan) -> np.ndarray:
    """Pack ids in serving order: by step, then rank, then slot; unscheduled packs last (in id order)."""
    unscheduled = plan.step < 0
    return np.lexsort((np.arange(len(plan.step)), plan.slot, plan.rank, plan.step, unscheduled))


def reorder(plan: DPPlan, order: np.ndarray) -> DPPlan:
    """The same schedule with pack `order[k]` renamed k."""
    return DPPlan(
        step=plan.step[order],
        rank=plan.rank[order],
        slot=plan.slot[order],
        data_parallel=plan.data_parallel,
        global_batch_size=plan.global_batch_size,
    )
