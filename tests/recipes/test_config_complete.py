"""A recipe's ConfigContainer is complete on its own: Megatron-Bridge's `pretrain()`/`finetune()` validate it before
any model exists (runtime_config_update), and that is where qvl checks the dataset against the recipe and attaches
its own behaviours, so `qvl train`, `nemo qvl` and a notebook calling Megatron-Bridge's loop behave the same."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from qvl.foundation.errors import ConfigError, DataError
from qvl.recipes.registry import get_recipe

TINY = dict(tensor_parallel=1, pipeline_parallel=1, seq_length=256, precision="fp32", sequence_parallel=False)


def _config(recipe: str, dataset, hf_path, **options):
    return get_recipe(recipe).fn(data=str(dataset), hf_path=str(hf_path), **TINY, **options)


def _validate(config) -> None:
    from megatron.bridge.training.config import runtime_config_update

    runtime_config_update(config)  # the first thing Megatron-Bridge's pretrain() and finetune() do


def test_megatron_bridges_own_validation_attaches_vision_recompute(tiny_dataset, tiny_qwen25_checkpoint):
    from transformers import AutoModel

    from qvl.bridges.tiny_model import tiny_hf_config

    config = _config("qwen2_5_vl_3b_sft", tiny_dataset, tiny_qwen25_checkpoint, vision_recompute=True)
    _validate(config)
    _validate(config)  # validated twice (qvl train checks before pretrain() does): the hook runs once
    tower = AutoModel.from_config(tiny_hf_config("qwen2_5_vl")).visual
    config.model.pre_wrap_hook([torch.nn.ModuleList([tower])])  # what Megatron-Bridge runs on the built model
    assert all(block.gradient_checkpointing for block in tower.blocks)


def test_a_dataset_for_another_family_is_refused(tiny_dataset, tiny_hf_dirs):
    config = _config("qwen2_vl_2b_sft", tiny_dataset, tiny_hf_dirs["qwen2_vl"])
    with pytest.raises(DataError, match="prepared for qwen2_5_vl, but this recipe trains qwen2_vl"):
        _validate(config)


def test_packs_longer_than_the_recipes_seq_length_are_refused(tiny_dataset, tiny_qwen25_checkpoint):
    config = _config("qwen2_5_vl_3b_sft", tiny_dataset, tiny_qwen25_checkpoint)
    config.model.seq_length = 128  # the pack plan was made for 256 tokens
    with pytest.raises(DataError, match=r"up to 256 tokens, longer than the recipe's seq_length=128.*--seq-length 128"):
        _validate(config)


def test_a_dp_plan_for_another_layout_is_refused(tiny_dataset, tiny_qwen25_checkpoint, tmp_path):
    planned = tmp_path / "planned"
    shutil.copytree(tiny_dataset, planned)
    report = json.loads((planned / "report.json").read_text())
    report["dp_plan"] = {"data_parallel": 4, "global_batch_size": 8, "packs_per_rank_per_step": 2}
    (planned / "report.json").write_text(json.dumps(report))
    config = _config("qwen2_5_vl_3b_sft", planned, tiny_qwen25_checkpoint, global_batch_size=8)
    with pytest.raises(DataError, match="this run trains at data_parallel=1.*planned for data_parallel=4"):
        _validate(config)


def test_vision_recompute_on_a_megatron_tower_is_refused_where_the_config_is_checked(tiny_hf_dirs, tmp_path):
    config = get_recipe("qwen3_vl_2b_sft").fn(hf_path=str(tiny_hf_dirs["qwen3_vl"]), **TINY, vision_recompute=True)
    from qvl.recipes.base import attach_qvl_behaviours

    with pytest.raises(ConfigError, match="recompute=full"):
        attach_qvl_behaviours(config)
