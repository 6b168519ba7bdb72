"""Every recipe builds a ConfigContainer offline; keyword arguments land in the right Megatron fields."""

from __future__ import annotations

import pytest

from qvl.foundation.errors import ConfigError
from qvl.recipes.registry import STAGES, all_recipes, current_name, get_recipe, old_name


@pytest.fixture(scope="module")
def recipes():
    return {r.name: r for r in all_recipes()}


def test_registry_covers_every_family_size_and_stage(recipes):
    by_family = {}
    for info in recipes.values():
        by_family.setdefault(info.family, set()).add((info.size, info.stage))
    expected = {
        "qwen2_vl": ["2b", "7b", "72b"],
        "qwen2_5_vl": ["3b", "7b", "32b", "72b"],
        "qwen3_vl": ["2b", "4b", "8b", "32b"],
        "qwen3_vl_moe": ["30b-a3b", "235b-a22b"],
    }
    for family, sizes in expected.items():
        assert by_family[family] == {(s, st) for s in sizes for st in STAGES}
    assert all(info.gpus >= 1 and "gpus" not in info.layout and info.summary for info in recipes.values())


def test_every_recipe_returns_a_config_container_with_its_default_layout(recipes):
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()  # with qvl's stand-ins, whichever test of this worker ran first
    from megatron.bridge.training.config import ConfigContainer

    from qvl.recipes.base import QvlPackedDatasetConfig
    from qvl.recipes.registry import ADAPTER_STAGES, PREFERENCE_STAGES

    for info in recipes.values():
        cfg = info.fn()
        assert isinstance(cfg, ConfigContainer), info.name
        assert cfg.model.tensor_model_parallel_size == info.layout.get("tensor_parallel", 1)
        assert cfg.model.pipeline_model_parallel_size == info.layout.get("pipeline_parallel", 1)
        assert cfg.model.expert_model_parallel_size == info.layout.get("expert_parallel", 1)
        assert isinstance(cfg.dataset, QvlPackedDatasetConfig) and cfg.dataset.family == info.family
        assert (cfg.peft is not None) == (info.stage in ADAPTER_STAGES), info.name
        assert (cfg.qvl.preference is not None) == (info.stage in PREFERENCE_STAGES), info.name
        assert cfg.model.seq_length == cfg.dataset.seq_length == 4096


def test_overrides_reach_megatron_fields():
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn(
        tensor_parallel=4,
        recompute="full",
        recompute_layers=2,
        optimizer_offload=0.6,
        freeze="vision,projector",
        precision="fp8-current",
        lr=3e-5,
        train_iters=50,
        checkpoint_dir="/tmp/ck",
        save_interval=7,
        wandb_project="qvl",
    )
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.sequence_parallel) == (4, True)
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "block", 2)
    assert m.freeze_vision_model and m.freeze_vision_projection and not m.freeze_language_model
    assert cfg.optimizer.optimizer_cpu_offload and cfg.optimizer.optimizer_offload_fraction == 0.6
    assert cfg.mixed_precision == "bf16_with_fp8_current_scaling_mixed"
    assert cfg.optimizer.lr == 3e-5 and cfg.scheduler.lr_decay_iters == 50
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.logger.wandb_project) == ("/tmp/ck", 7, "qvl")


def test_moe_defaults_are_explicit_not_the_providers_frozen_defaults():
    cfg = get_recipe("qwen3_vl_30b_a3b_sft").fn()
    assert not cfg.model.freeze_language_model and not cfg.model.freeze_vision_model  # provider defaults True
    assert cfg.model.moe_token_dispatcher_type == "alltoall"


def test_pipeline_split_is_set_from_the_model():
    cfg = get_recipe("qwen2_5_vl_72b_sft").fn()
    first, last = cfg.model.num_layers_in_first_pipeline_stage, cfg.model.num_layers_in_last_pipeline_stage
    assert first < 80 // 4 and first + last + 2 * ((80 - first - last) // 2) == 80
    cfg = get_recipe("qwen2_5_vl_72b_sft").fn(pipeline_split="20,20")
    assert (cfg.model.num_layers_in_first_pipeline_stage, cfg.model.num_layers_in_last_pipeline_stage) == (20, 20)
    cfg = get_recipe("qwen2_5_vl_72b_sft").fn(pipeline_split="uniform")
    assert cfg.model.num_layers_in_first_pipeline_stage is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tensor_parallel": 3}, "tensor_parallel=3 does not divide qwen2_5_vl 7b's 28 attention heads"),
        ({"tensor_paralel": 2}, "'tensor_paralel' is not a recipe option; did you mean tensor_parallel"),
        ({"precision": "fp4"}, "bf16-mixed"),
        ({"recompute": "some"}, "selective"),
        ({"recompute": "selective", "recompute_modules": "core_attn,layer_norm"}, "recompute_modules='layer_norm'"),
        ({"recompute": "selective", "recompute_modules": "gdn_norm_out"}, "no Gated DeltaNet layers"),
        ({"optimizer_offload": 60}, "optimizer_offload=0.6"),
        ({"freeze": "eyes"}, "projector"),
        ({"virtual_pipeline": 2}, "pipeline_parallel >= 2"),
        ({"expert_parallel": 2}, "expert_parallel=2 needs a mixture-of-experts model"),
        ({"pipeline_parallel": 4, "pipeline_split": "1,2"}, "pipeline_split=auto"),
        ({"vision_balance": True, "context_parallel": 2}, "set context_parallel=1 or drop vision_balance"),
    ],
)
def test_bad_arguments_fail_naming_value_and_fix(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_recipe("qwen2_5_vl_7b_sft").fn(**overrides)


def test_packed_dataset_config_refuses_a_missing_dataset(tmp_path):
    dataset = get_recipe("qwen3_vl_8b_sft").fn().dataset
    with pytest.raises(ValueError, match="pass data=DIR"):
        dataset.finalize()
    dataset = get_recipe("qwen3_vl_8b_sft").fn(data=str(tmp_path)).dataset
    with pytest.raises(ValueError, match="qvl data prepare"):
        dataset.finalize()
    (tmp_path / ".nv-meta").mkdir()
    dataset.finalize()
    assert (dataset.path, dataset.hf_path, dataset.family) == (str(tmp_path), "Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl")


def test_a_packed_dataset_names_its_tower_calls_where_a_micro_batch_is_one_pack(tmp_path):
    """Its packs.jsonl plans a graphed vision tower's bucket sizes (qvl.kernels.speed_cuda_graphs.planned_dataset)
    only where each tower call is one pack's media."""
    from qvl.kernels.speed_cuda_graphs import planned_dataset

    config = get_recipe("qwen2_5_vl_3b_sft").fn(data=str(tmp_path))
    assert config.dataset.tower_calls_dataset() == str(tmp_path) == planned_dataset(config)
    config.dataset.micro_batch_size = 2
    assert config.dataset.tower_calls_dataset() is None and planned_dataset(config) is None


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("qwen2_vl", "qwen2_vl_2b_peft"),
        ("qwen2_5_vl", "qwen2_5_vl_3b_sft"),
        ("qwen3_vl", "qwen3_vl_2b_pretrain"),
        ("qwen3_vl_moe", "qwen3_vl_30b_a3b_sft"),
    ],
)
def test_recipe_reads_a_local_checkpoint_config(tiny_hf_dirs, family, name):
    cfg = get_recipe(name).fn(hf_path=str(tiny_hf_dirs[family]), tensor_parallel=1, expert_parallel=1)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (64, 4, 512)


def test_vision_balance_reaches_the_training_config_and_its_yaml(tmp_path):
    from qvl.recipes.base import QvlConfigContainer
    from qvl.recipes.overrides import parse_overrides

    assert not get_recipe("qwen2_5_vl_7b_sft").fn().qvl.vision_balance
    assert get_recipe("qwen2_vl_7b_sft").fn(**parse_overrides(["vision_balance=true"]).as_dict()).qvl.vision_balance
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn(vision_balance=True)
    cfg.to_yaml(str(tmp_path / "run_config.yaml"))  # what Megatron-Bridge writes beside every checkpoint
    loaded = QvlConfigContainer.from_yaml(str(tmp_path / "run_config.yaml"))
    assert isinstance(loaded, QvlConfigContainer) and loaded.qvl.vision_balance is True


def test_vision_balance_is_refused_for_qwen3_vl():
    with pytest.raises(ValueError, match="not supported for qwen3_vl yet.*drop vision_balance"):
        get_recipe("qwen3_vl_8b_sft").fn(vision_balance=True)


@pytest.mark.parametrize("fixed", [dict(pipeline_parallel=2), dict(cuda_graphs=True)])
def test_a_padded_seq_length_must_split_evenly_over_the_sequence_parallel_ranks(fixed):
    with pytest.raises(ValueError, match="seq_length=4097 is not a multiple of tensor_parallel=2.*use seq_length=4096"):
        get_recipe("qwen2_5_vl_3b_sft").fn(tensor_parallel=2, seq_length=4097, **fixed)
    get_recipe("qwen2_5_vl_3b_sft").fn(tensor_parallel=2, seq_length=4097)  # each pack is padded to an even length


def test_old_recipe_spellings_keep_working_with_a_note(recipes, caplog):
    renamed = [name for name in recipes if old_name(name)]
    assert {name.split("_vl_")[0] for name in renamed} == {"qwen2_5", "qwen3_5", "qwen3_6", "qwen3_8"}
    for name in renamed:
        assert current_name(old_name(name)) == name and old_name(name) not in recipes
    with caplog.at_level("WARNING", logger="qvl"):
        assert get_recipe("qwen25_vl_3b_sft") is recipes["qwen2_5_vl_3b_sft"]
        assert get_recipe("qwen35_vl_9b_peft") is recipes["qwen3_5_vl_9b_peft"]
    assert "'qwen25_vl_3b_sft' is now 'qwen2_5_vl_3b_sft'" in caplog.text
    assert old_name("qwen3_vl_4b_sft") is None and current_name("qwen3_vl_4b_sft") == "qwen3_vl_4b_sft"


def test_a_moe_models_expert_activation_is_recomputed_only_where_its_experts_are_grouped():
    """Megatron-Core recomputes an expert's activation (moe_act) only in its grouped-GEMM experts, which need TE; the
    recipe says so in one line, with the option that recomputes the MoE layers instead (not a ValueError from inside
    the config's finalisation at the run's start)."""
    from qvl.foundation import megatron

    if megatron.have_transformer_engine():
        pytest.skip("with Transformer Engine the experts are grouped GEMMs")
    with pytest.raises(ConfigError, match=r"recompute_modules=moe_act: .*recompute_modules=moe"):
        get_recipe("qwen3_vl_30b_a3b_sft").fn(recompute="selective", recompute_modules="core_attn,moe_act")
    cfg = get_recipe("qwen3_vl_30b_a3b_sft").fn(recompute="selective", recompute_modules="core_attn,moe")
    assert cfg.model.recompute_modules == ["core_attn", "moe"]
