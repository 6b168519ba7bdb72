"""The shapes a graphed vision tower call is padded into (qvl.kernels.tower_buckets): the geometric grid, the bucket
sizes planned from a dataset's calls (checked against every choice of sizes on small cases), and slots that grow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from qvl.kernels.tower_buckets import TowerBucket, bucket_size, padding_share, planned_sizes, tower_bucket


def test_a_bucket_holds_at_most_an_eighth_more_rows_and_slots_to_spare():
    assert tower_bucket(12_000, 20, 300, unit=64, window=64, longest=2_000) == TowerBucket(
        patches=12_288, blocks=32, windows=384, longest=2_048
    )
    assert tower_bucket(8_192, 3, None, unit=4, window=None, longest=8_192) == TowerBucket(
        patches=8_192, blocks=16, windows=0, longest=8_192
    )
    assert tower_bucket(8_193, 3, None, unit=4, window=None, longest=1).patches == 9_216  # 12.5%: the most it adds
    assert tower_bucket(100, 1, 4, unit=64, window=64, longest=100) == TowerBucket(
        patches=128,
        blocks=16,
        windows=128,
        longest=128,  # the longest block is at most the bucket's rows
    )
    for rows_in in range(4, 5_000, 4):
        rows = tower_bucket(rows_in, 1, 1, unit=64, window=64, longest=rows_in).patches
        assert rows % 64 == 0 and rows_in <= rows <= max(rows_in + 63, rows_in * 9 // 8 + 64)
    # 15 blocks leave one slot for the pad block; the pad rows get whole windows beyond the call's
    assert tower_bucket(168, 15, 120, unit=16, window=16, longest=96) == TowerBucket(
        patches=176, blocks=16, windows=128, longest=176
    )
    assert tower_bucket(168, 16, 128, unit=16, window=16, longest=96) == TowerBucket(
        patches=176, blocks=32, windows=256, longest=176
    )
    with pytest.raises(ValueError, match="a tower call of 0 pixel rows has no bucket"):
        tower_bucket(0, 0, None, unit=4, window=None, longest=1)


def test_the_pad_rows_take_blocks_no_longer_than_the_calls_longest():
    """The kernels' max_seqlen is the call's longest block rounded up to 256 rows, not the bucket's: 1,000 pad rows
    in blocks of at most 256 are four blocks, which with 13 of the call's need 32 slots."""
    bucket = tower_bucket(1_000, 13, None, unit=4, window=None, longest=200, sizes=(2_000,))
    assert bucket == TowerBucket(patches=2_000, blocks=32, windows=0, longest=256)
    assert tower_bucket(1_000, 12, None, unit=4, window=None, longest=200, sizes=(2_000,)).blocks == 16


def test_a_planned_size_takes_the_call_and_a_call_above_them_all_the_grid():
    sizes = (1_024, 4_096)
    assert tower_bucket(900, 3, 10, unit=64, window=64, longest=500, sizes=sizes) == TowerBucket(
        patches=1_024, blocks=16, windows=128, longest=512
    )
    assert bucket_size(1_024, unit=64, sizes=sizes) == 1_024 and bucket_size(1_025, unit=64, sizes=sizes) == 4_096
    assert bucket_size(4_100, unit=64, sizes=sizes) == bucket_size(4_100, unit=64) == 4_608  # the geometric grid


def _least_padded(rows: list[int], unit: int, most: int) -> int:
    """The fewest rows any choice of at most `most` sizes among the calls' own (rounded) sizes pads them to."""
    values = sorted({unit * -(-r // unit) for r in rows})
    best = None
    for k in range(1, min(most, len(values)) + 1):
        for chosen in itertools.combinations(values[:-1], k - 1):
            sizes = (*chosen, values[-1])
            total = sum(bucket_size(r, unit=unit, sizes=sizes) for r in rows)
            best = total if best is None else min(best, total)
    return best


def test_the_planned_sizes_pad_the_calls_least():
    rng = np.random.default_rng(0)
    for case in range(40):
        unit = int(rng.choice([4, 64]))
        rows = rng.integers(1, 60, size=int(rng.integers(1, 14))) * 4 * int(rng.integers(1, 30))
        most = int(rng.integers(1, 5))
        sizes = planned_sizes(rows.tolist() + [0, 0], unit=unit, most=most)  # zeros: packs without such media
        assert 1 <= len(sizes) <= most and list(sizes) == sorted(set(sizes)), case
        assert all(size % unit == 0 for size in sizes) and sizes[-1] == unit * -(-int(rows.max()) // unit)
        padded = sum(bucket_size(int(r), unit=unit, sizes=sizes) for r in rows)
        assert padded == _least_padded(rows.tolist(), unit, most), case
    assert planned_sizes([0, 0], unit=4, most=16) == () and planned_sizes([8], unit=4, most=0) == ()


def test_a_dataset_of_few_call_sizes_is_padded_to_the_unit_only():
    calls = [6_336, 13_744, 13_744, 16_052, 6_336] * 50
    sizes = planned_sizes(calls, unit=64, most=16)
    assert sizes == (6_336, 13_760, 16_064)
    assert padding_share(calls, sizes, unit=64) == pytest.approx((16 + 16 + 12) * 50 / sum(calls))
    assert padding_share(calls, (), unit=64) > 0.01  # the geometric grid: 6,336 -> 6,656, 13,744 -> 14,336
    assert padding_share([], sizes, unit=64) == 0.0


def test_many_distinct_call_sizes_are_planned_on_a_fine_grid_first():
    rows = np.arange(4, 4 * 5_000, 4)  # 4,999 distinct sizes
    sizes = planned_sizes(rows, unit=4, most=16)
    assert len(sizes) == 16 and sizes[-1] >= rows.max()
    even = tuple(int(r) for r in np.linspace(0, 20_000, 17)[1:])  # the best sizes for calls spread evenly
    planned, best = padding_share(rows, sizes, unit=4), padding_share(rows, even, unit=4)
    assert best <= planned < best + 1 / 128  # the fine grid adds at most 1/128


def test_short_slots_grow_to_at_least_twice_theirs():
    bucket = TowerBucket(patches=1_024, blocks=16, windows=128, longest=256)
    assert bucket.holds(TowerBucket(patches=1_024, blocks=16, windows=128, longest=256))
    needed = TowerBucket(patches=1_024, blocks=32, windows=128, longest=256)
    assert not bucket.holds(needed)
    assert bucket.grown(needed) == TowerBucket(patches=1_024, blocks=32, windows=128, longest=256)
    assert bucket.grown(TowerBucket(patches=1_024, blocks=80, windows=256, longest=768)) == TowerBucket(
        patches=1_024, blocks=80, windows=256, longest=768
    )
    assert bucket.grown(TowerBucket(patches=1_024, blocks=16, windows=200, longest=256)).windows == 256
    assert not bucket.holds(TowerBucket(patches=1_024, blocks=16, windows=128, longest=512))
    assert bucket.grown(TowerBucket(patches=1_024, blocks=16, windows=128, longest=300)).longest == 512
    wide = TowerBucket(patches=1_024, blocks=16, windows=128, longest=768)
    assert wide.grown(TowerBucket(patches=1_024, blocks=16, windows=128, longest=1_024)).longest == 1_024  # its rows
