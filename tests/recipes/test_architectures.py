"""The published architecture table against the parameter counts of the released checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from qvl.recipes.architectures import ARCHITECTURES, get_architecture, hf_config, load_hf_config

# Total parameters of the released checkpoints (safetensors headers of the Hugging Face hub repos).
PUBLISHED = {
    ("qwen2_vl", "2b"): 2_208_985_600,
    ("qwen2_vl", "7b"): 8_291_375_616,
    ("qwen2_5_vl", "7b"): 8_292_166_656,
    ("qwen3_vl", "8b"): 8_767_123_696,
}


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_table_rebuilds_the_published_parameter_count(key):
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(hf_config(ARCHITECTURES[key]))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[key]


def test_every_family_has_its_sizes_and_config_class():
    sizes = {f: sorted(s for g, s in ARCHITECTURES if g == f) for f, _ in ARCHITECTURES}
    assert sizes["qwen2_vl"] == ["2b", "72b", "7b"]
    assert sizes["qwen2_5_vl"] == ["32b", "3b", "72b", "7b"]
    assert sizes["qwen3_vl"] == ["2b", "32b", "4b", "8b"]
    assert sizes["qwen3_vl_moe"] == ["235b-a22b", "30b-a3b"]
    assert sizes["qwen3_5_vl"] == ["27b", "3.6-27b", "3.8-27b", "9b"]  # Qwen3.6 and Qwen3.8: the same classes
    assert sizes["qwen3_5_vl_moe"] == ["3.6-35b-a3b", "35b-a3b", "397b-a17b"]
    config = hf_config(get_architecture("qwen3_vl_moe", "30b-a3b"))
    assert type(config).__name__ == "Qwen3VLMoeConfig" and config.text_config.num_experts == 128
    assert config.architectures == ["Qwen3VLMoeForConditionalGeneration"]


def test_unknown_size_names_the_sizes_that_exist():
    with pytest.raises(KeyError, match="2b, 72b, 7b"):
        get_architecture("qwen2_vl", "3b")


def test_local_checkpoint_config_wins_and_a_foreign_one_is_refused(tiny_hf_dirs):
    arch = get_architecture("qwen2_5_vl", "7b")
    assert load_hf_config(tiny_hf_dirs["qwen2_5_vl"], arch).text_config.hidden_size == 64
    assert load_hf_config("Qwen/not-a-local-dir", arch).text_config.hidden_size == 3584  # table, no download
    with pytest.raises(ValueError, match="Qwen3VLForConditionalGeneration"):
        load_hf_config(tiny_hf_dirs["qwen3_vl"], arch)
