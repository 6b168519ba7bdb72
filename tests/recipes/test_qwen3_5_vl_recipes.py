"""Qwen3.5-VL recipes (and Qwen3.6 / Qwen3.8's): what the planner counts that other families do not have (Gated
DeltaNet layers, the 248,320-token vocabulary's logits), multi-token prediction where Megatron-Bridge trains it when
the checkpoint has a head (none built when it has none), and the vision balancing refusal shared with Qwen3-VL."""

from __future__ import annotations

from pathlib import Path

import pytest

from qvl.foundation.errors import ConfigError
from qvl.recipes import activations, shapes
from qvl.recipes.planner import GIB, plan_config
from qvl.recipes.registry import all_recipes, get_recipe


def test_thirty_five_recipes_and_the_hybrid_pattern_of_the_published_sizes():
    names = {r.name for r in all_recipes() if r.family.startswith("qwen3_5_vl")}
    assert len(names) == 7 * 5 and "qwen3_5_vl_397b_a17b_dpo_peft" in names  # 7 sizes x 5 stages
    assert {"qwen3_6_vl_27b_sft", "qwen3_6_vl_35b_a3b_peft", "qwen3_8_vl_27b_sft"} <= names  # Qwen3.6 and Qwen3.8
    model = get_recipe("qwen3_5_vl_27b_sft").fn().model
    assert shapes.gated_delta_layers(model) == 48 and model.num_layers == 64  # 16 x (3 DeltaNet + 1 attention)
    counts = shapes.lm_param_counts(model)
    assert counts["embedding"] == counts["output"] == 248_320 * 5120  # untied, the vocabulary padded by TP already


def test_planner_counts_deltanet_state_and_the_vocabulary_logits():
    cfg = get_recipe("qwen3_5_vl_9b_sft").fn()
    model = cfg.model
    # fla's chunked kernel keeps a fp32 [value heads, key dim, value dim] state every 64 tokens: 2 MiB per chunk at 9B
    state_per_token = 4 * model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim / 64
    assert activations.gated_delta_bytes_per_token(model) > state_per_token == 32_768
    plan = plan_config(cfg, gpus=4)
    logits = 4096 * 4 * (model.hidden_size + shapes.padded_vocab(model)) / model.tensor_model_parallel_size
    assert logits / GIB > 0.9 and plan.stages[-1].activations > logits  # the 248k-vocabulary loss buffer is in there


def test_vision_balance_is_refused_with_the_reason():
    with pytest.raises(
        ConfigError, match="vision_balance=True is not supported for qwen3_5_vl.*tensor-parallel itself"
    ):
        get_recipe("qwen3_5_vl_9b_sft").fn(vision_balance=True)


@pytest.mark.parametrize(
    "name, mtp_layers",
    [
        ("qwen3_5_vl_9b_pretrain", None),  # pretraining leaves the MTP head aside
        ("qwen3_5_vl_9b_sft", 1),
        ("qwen3_6_vl_35b_a3b_peft", 1),
        ("qwen3_8_vl_27b_sft", 1),
    ],
)
def test_mtp_trains_by_default_in_sft_and_peft_at_megatron_bridges_scale(name, mtp_layers):
    model = get_recipe(name).fn().model
    assert model.mtp_num_layers == mtp_layers
    assert mtp_layers is None or model.mtp_loss_scaling_factor == 0.1
    assert get_recipe(name).fn(mtp=False).model.mtp_num_layers is None


def test_mtp_is_refused_for_a_family_without_it_and_with_context_parallelism():
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers.*train with mtp=false"):
        get_recipe("qwen3_vl_8b_sft").fn(mtp=True)
    with pytest.raises(ConfigError, match="mtp=true needs context_parallel=1"):
        get_recipe("qwen3_5_vl_9b_sft").fn(mtp=True, context_parallel=2)
    # followed from the checkpoint, the head is left aside where context parallelism cannot train it
    assert get_recipe("qwen3_5_vl_9b_sft").fn(context_parallel=2).model.mtp_num_layers is None


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> dict[str, str]:
    """Tiny Qwen3.5-VL checkpoints without an MTP head: dense and MoE as transformers saves them (no `mtp.*`), and
    dense built without `mtp_num_hidden_layers`."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from tests.bridges.test_qwen3_5_vl import without_mtp_head

    root = tmp_path_factory.mktemp("headless")
    return {
        "qwen3_5_vl": str(without_mtp_head(write_tiny_hf_checkpoint(root / "dense", "qwen3_5_vl"))),
        "qwen3_5_vl_moe": str(without_mtp_head(write_tiny_hf_checkpoint(root / "moe", "qwen3_5_vl_moe"))),
        "unconfigured": str(without_mtp_head(write_tiny_hf_checkpoint(root / "bare", "qwen3_5_vl"), in_config=True)),
    }


FINE_TUNES = sorted(r.name for r in all_recipes() if r.family.startswith("qwen3_5_vl") and r.stage in ("sft", "peft"))


def test_a_checkpoint_without_an_mtp_head_trains_with_every_fine_tuning_recipe_without_options(
    headless, tmp_path, caplog
):
    """As `qvl train RECIPE hf_path=HF --model tiny` prepares it: no MTP layers built, one info line saying why;
    the same recipes on a checkpoint with a head train it (test_train_mtp.py)."""
    from qvl.training.loop import TrainRequest, prepare_config

    assert len(FINE_TUNES) == 14
    for name in FINE_TUNES:
        hf = headless[get_recipe(name).family]
        caplog.clear()
        with caplog.at_level("INFO", logger="qvl.recipes.base"):
            request = TrainRequest(recipe=name, overrides={"hf_path": hf}, run_dir=tmp_path / name, model="tiny")
            config = prepare_config(request, cpu=True)[1]
        assert config.model.mtp_num_layers is None, name
        lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
        assert lines == [f"multi-token prediction: hf_path={hf} has no MTP head; training without"], (name, lines)
    bare = TrainRequest(recipe="qwen3_5_vl_9b_peft", overrides={"hf_path": headless["unconfigured"]},
                        run_dir=tmp_path / "bare", model="tiny")  # fmt: skip
    assert prepare_config(bare, cpu=True)[1].model.mtp_num_layers is None


def test_mtp_typed_on_a_checkpoint_without_a_head_is_the_one_error_and_names_mtp_false(headless, tmp_path):
    from qvl.training.loop import TrainRequest, prepare_config

    for hf, found in ((headless["qwen3_5_vl"], "has no multi-token-prediction weights"),
                      (headless["unconfigured"], "has no multi-token-prediction layers")):  # fmt: skip
        request = TrainRequest(recipe="qwen3_5_vl_9b_sft", overrides={"hf_path": hf, "mtp": True}, run_dir=tmp_path,
                               model="tiny")  # fmt: skip
        with pytest.raises(ConfigError, match=f"mtp=true, but .*{found}.*; train with mtp=false$"):
            prepare_config(request, cpu=True)


def test_the_plan_reports_the_mtp_share_of_a_step():
    """One MTP depth of the 9B is one attention layer, its MLP, its own projections and a second 248k-vocabulary
    output layer, against 32 decoder layers, the output layer and the vision tower: about a seventh of the FLOPs."""
    cfg = get_recipe("qwen3_5_vl_9b_sft").fn()
    share = plan_config(cfg, gpus=4).mtp_share
    model = cfg.model
    h, vocab = model.hidden_size, shapes.padded_vocab(model)
    assert 2 * h * vocab / (model.num_layers * 2 * h * model.ffn_hidden_size * 3) > 0.2  # why the share is large
    assert 0.08 < share < 0.2, share
    assert plan_config(get_recipe("qwen3_5_vl_9b_sft").fn(mtp=False), gpus=4).mtp_share == 0.0
    assert plan_config(get_recipe("qwen3_5_vl_9b_pretrain").fn(), gpus=4).mtp_share == 0.0


def fake_megatron_checkpoint(path: Path, names: list[str]) -> Path:
    """A torch_dist checkpoint folder holding zero tensors of `names` (all the recipe reads is its metadata)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from qvl.bridges.checkpoints import LATEST_FILE

    dcp.save({name: torch.zeros(1) for name in names}, checkpoint_id=str(path / "iter_0000001"), no_dist=True)
    (path / LATEST_FILE).write_text("1")
    return path


def test_the_checkpoint_training_starts_from_decides_whether_mtp_trains(headless, tmp_path):
    """The pretrained Megatron checkpoint decides over the HF folder beside it, and a run's own checkpoint (resuming)
    over both: a head trains where the weights training starts from have one."""
    layers = ["language_model.decoder.layers.0.mlp.linear_fc1.weight"]
    with_head = fake_megatron_checkpoint(tmp_path / "with", [*layers, "language_model.mtp.layers.0.enorm.weight"])
    without = fake_megatron_checkpoint(tmp_path / "without", layers)
    recipe = get_recipe("qwen3_5_vl_9b_sft").fn
    common = dict(hf_path=headless["qwen3_5_vl"], tensor_parallel=1, checkpoint_dir=str(tmp_path / "run"))
    assert recipe(**common, pretrained_checkpoint=str(with_head)).model.mtp_num_layers == 1
    assert recipe(**common, pretrained_checkpoint=str(without)).model.mtp_num_layers is None
    with pytest.raises(ConfigError, match=f"mtp=true, but pretrained_checkpoint={without} has no .*mtp=false$"):
        recipe(**common, pretrained_checkpoint=str(without), mtp=True)
    resumed = {**common, "checkpoint_dir": str(with_head)}
    assert recipe(**resumed, pretrained_checkpoint=str(without)).model.mtp_num_layers == 1
