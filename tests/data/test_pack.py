"""The grouped packer must equal per-item best-fit decreasing, place every item once, and be deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from qvl.data.pack import balance_by_cost, pack_best_fit_decreasing, pack_next_fit, pack_padded
from qvl.foundation.cost import sample_flops
from qvl.recipes.architectures import cost_shapes

# Qwen2.5-VL-7B's language model and vision tower (the cost model's FLOPs, as --balance-cost uses them).
LM_7B, VISION_7B = cost_shapes("qwen2_5_vl", "7b")


def _naive_best_fit_decreasing_loads(lengths: list[int], seq_length: int) -> list[int]:
    capacities: list[int] = []
    for length in sorted(lengths, reverse=True):
        fitting = [i for i, c in enumerate(capacities) if c >= length]
        if fitting:
            best = min(fitting, key=lambda i: capacities[i])
        else:
            capacities.append(seq_length)
            best = len(capacities) - 1
        capacities[best] -= length
    return sorted(seq_length - c for c in capacities)


def test_equals_per_item_best_fit_decreasing():
    rng = np.random.default_rng(0)
    for trial in range(200):
        seq_length = int(rng.integers(5, 300))
        n = int(rng.integers(0, 250))
        lengths = rng.integers(1, seq_length + 1, n) if trial % 2 else np.minimum(rng.geometric(0.05, n), seq_length)
        plan = pack_best_fit_decreasing(lengths, seq_length)
        loads = sorted(plan.pack_tokens(lengths).tolist())
        assert loads == _naive_best_fit_decreasing_loads(lengths.tolist(), seq_length)
        assert sorted(plan.order.tolist()) == list(range(n))
        assert (plan.pack_tokens(lengths) <= seq_length).all()


def test_deterministic_and_longest_first_within_pack():
    lengths = np.random.default_rng(1).integers(1, 900, 5000)
    a, b = pack_best_fit_decreasing(lengths, 1024), pack_best_fit_decreasing(lengths.copy(), 1024)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.offsets, b.offsets)
    for k in range(a.n_packs):
        assert (np.diff(lengths[a.pack(k)]) <= 0).all()


def test_efficiency_beats_baselines_on_a_mixed_length_distribution():
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(6.3, 0.7, 20000).astype(int), 1, 8192)
    best = pack_best_fit_decreasing(lengths, 8192).efficiency(lengths)
    assert best > 0.995
    assert best > pack_next_fit(lengths, 8192).efficiency(lengths) > pack_padded(lengths, 8192).efficiency(lengths)


def test_rejects_items_longer_than_seq_length_naming_the_fix():
    with pytest.raises(ValueError, match="quarantine or truncate"):
        pack_best_fit_decreasing(np.array([10, 300]), 256)


def test_balance_by_cost_keeps_fill_and_reduces_cost_spread():
    rng = np.random.default_rng(3)
    lengths = rng.choice([300, 600, 1200], 4000)
    # Equal lengths, unequal compute: half the samples spend their tokens on one large image, half on text.
    has_image = rng.random(4000) < 0.5
    owners = np.flatnonzero(has_image)
    grids = np.tile([1, 32, 32], (len(owners), 1))  # 1024 patches -> 256 image tokens
    costs = sample_flops(LM_7B, VISION_7B, lengths, grids, owners)
    assert costs[has_image].mean() > 1.1 * costs[~has_image].mean()
    plan = pack_best_fit_decreasing(lengths, 2048)
    balanced = balance_by_cost(plan, lengths, costs)
    assert np.array_equal(plan.pack_tokens(lengths), balanced.pack_tokens(lengths))
    assert sorted(balanced.order.tolist()) == list(range(len(lengths)))

    def spread(p):
        return np.add.reduceat(costs[p.order], p.offsets[:-1]).std()

    assert spread(balanced) < 0.9 * spread(plan)
