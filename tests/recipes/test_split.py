"""Pipeline split: vision cost on stage 0, head on the last stage, Megatron-Core's divisibility rules."""

from __future__ import annotations

import pytest

from qvl.recipes.split import StageCosts, balanced_split, check_split, counts, parse_split


def test_no_vision_no_head_is_uniform():
    split = balanced_split(32, 4, None, StageCosts(layer=1.0, vision=0.0, head=0.0))
    assert split.layers == (8, 8, 8, 8) and split.imbalance == pytest.approx(1.0)


def test_vision_cost_moves_layers_off_stage_0_and_head_off_the_last():
    split = balanced_split(32, 4, None, StageCosts(layer=1.0, vision=4.0, head=2.0))
    assert split.first < 8 and split.last <= 8 and sum(split.layers) == 32
    assert max(split.costs) < 8 + 4  # better than the uniform split's stage 0


def test_vpp_keeps_every_stage_a_multiple_of_it():
    split = balanced_split(48, 4, 2, StageCosts(layer=1.0, vision=5.0, head=1.0))
    assert all(n % 2 == 0 for n in split.layers) and sum(split.layers) == 48
    assert check_split(48, 4, 2, split.first, split.last) is None


def test_megatron_rules_and_user_splits():
    assert check_split(28, 2, None, 13, 15) is None
    assert "must equal" in check_split(28, 2, None, 13, 14)
    assert "middle" in check_split(31, 4, None, 6, 6)  # 19 middle layers do not split over 2 stages
    assert check_split(30, 4, None, 6, 8) is None  # 16 do
    assert parse_split("6,8", 30, 4, None) == (6, 8)
    with pytest.raises(ValueError, match="FIRST,LAST"):
        parse_split("six", 30, 4, None)
    with pytest.raises(ValueError, match="do not divide"):
        parse_split("uniform", 30, 4, None)
    assert counts(30, 4, 6, 8) == [6, 8, 8, 8]


def test_impossible_layout_names_the_fix():
    with pytest.raises(ValueError, match="pipeline_parallel"):
        balanced_split(4, 8, None, StageCosts(layer=1.0, vision=0.0, head=0.0))


def test_head_cost_alone_moves_layers_off_the_last_stage():
    split = balanced_split(32, 4, None, StageCosts(layer=1.0, vision=0.0, head=4.0))
    assert split.last < split.first
