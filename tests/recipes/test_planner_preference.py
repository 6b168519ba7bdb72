"""The planner on preference recipes: with the reference precomputed, a `dpo` run holds what its SFT recipe holds and
a `dpo_peft` run what its PEFT recipe holds (no second model; a pair's two sequences are sub-sequences of one pack), and
a preference dataset's workload counts a pair as two sub-sequences."""

from __future__ import annotations

import pytest

from qvl.recipes.planner import plan_config
from qvl.recipes.registry import get_recipe
from qvl.recipes.split import workload_of_dataset


@pytest.mark.parametrize(("preference", "base"), [("qwen2_5_vl_7b_dpo", "qwen2_5_vl_7b_sft"),
                                                  ("qwen3_vl_30b_a3b_dpo_peft", "qwen3_vl_30b_a3b_peft")])  # fmt: skip
def test_a_preference_run_plans_as_the_run_it_starts_from(preference, base):
    info = get_recipe(preference)
    plans = [plan_config(get_recipe(name).fn(), gpus=info.gpus) for name in (preference, base)]
    assert plans[0].fits and [s.total for s in plans[0].stages] == [s.total for s in plans[1].stages]
    assert plans[0].params_trainable == plans[1].params_trainable


def test_a_pair_is_two_sub_sequences_of_the_workload():
    pairs = {"kind": "preference", "accepted": 10, "total_tokens": 20_000, "media": 10, "vision_patches": 40_000}
    sft = {**pairs, "kind": "sft"}
    assert workload_of_dataset(pairs, seq_length=4096, merge=2).sample_tokens == 1000
    assert workload_of_dataset(sft, seq_length=4096, merge=2).sample_tokens == 2000
