"""What a preference recipe refuses, each in one line that names the value and the fix: what splits a pair's
sequences (context parallelism), a head without a pair objective (MTP), a second pass of the model that the layout
cannot run (reference=adapters with pipeline stages) or that captured graphs cannot (cuda_graphs)."""

from __future__ import annotations

import re

import pytest

from qvl.foundation.errors import ConfigError
from qvl.recipes.registry import get_recipe


@pytest.mark.parametrize(
    ("recipe", "options", "refusal"),
    [
        ("qwen2_5_vl_3b_dpo", {"context_parallel": 2}, "context_parallel=2: a preference stage sums"),
        ("qwen3_5_vl_9b_dpo", {"mtp": True}, "mtp=true: preference stages train the language-model head only"),
        ("qwen2_5_vl_3b_dpo_peft", {"reference": "adapters", "pipeline_parallel": 2}, "pipeline_parallel=2 cannot"),
        ("qwen2_5_vl_3b_dpo", {"cuda_graphs": True}, "cuda_graphs=true: a preference step's packs are not padded"),
        ("qwen3_vl_30b_a3b_dpo_peft", {"cuda_graphs": True}, "use cuda_graphs=false"),
    ],
)
def test_a_preference_recipe_refuses_what_a_pair_cannot_train_with(recipe, options, refusal):
    fn = get_recipe(recipe).fn
    fn()  # the recipe's own options build
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        fn(**options)
