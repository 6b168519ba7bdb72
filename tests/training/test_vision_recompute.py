"""`vision_recompute`: the replicated HF vision tower (Qwen2-VL / Qwen2.5-VL) keeps only its blocks' inputs for
backward. The recomputed tower gives the same gradients; the planner counts the smaller activations; Qwen3-VL's
Megatron tower is refused with the option that does recompute it. (The tiny training runs of test_train.py resume
with it on and must reproduce the uninterrupted run's losses bit for bit.)"""

from __future__ import annotations

import copy

import pytest
import torch

from qvl.recipes.registry import get_recipe


@pytest.mark.parametrize("blocks", [None, 1])
def test_recomputed_tower_gives_the_same_embeddings_and_gradients(blocks):
    from transformers import AutoModel

    from qvl.bridges.providers import RecomputeVisionTowers
    from qvl.bridges.tiny_model import tiny_hf_config

    torch.manual_seed(0)
    reference = AutoModel.from_config(tiny_hf_config("qwen2_5_vl")).visual.float()
    tower = copy.deepcopy(reference)
    RecomputeVisionTowers(blocks=blocks)([torch.nn.ModuleList([tower])])
    depth = len(tower.blocks)
    assert depth > 1
    expected = [index < (depth if blocks is None else blocks) for index in range(depth)]
    assert [block.gradient_checkpointing for block in tower.blocks] == expected
    assert not any(block.gradient_checkpointing for block in reference.blocks)
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])
    vision = reference.config
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size**2)
    results = []
    for model in (tower, reference):
        model.train()
        out = model(pixels, grid_thw=grid).pooler_output
        out.square().mean().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()]))
    (out, grads), (out_ref, grads_ref) = results
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-7)


def test_planner_counts_block_inputs_only_with_vision_recompute():
    from qvl.recipes.planner import plan_config
    from qvl.recipes.split import Workload

    workload = Workload(seq_length=4096, sample_tokens=600, vision_token_fraction=0.6, patches_per_image=1300)
    plain = plan_config(get_recipe("qwen2_5_vl_3b_pretrain").fn(seq_length=4096), gpus=1, workload=workload)
    recomputed = plan_config(
        get_recipe("qwen2_5_vl_3b_pretrain").fn(seq_length=4096, vision_recompute=True), gpus=1, workload=workload
    )
    assert recomputed.worst.activations < 0.7 * plain.worst.activations  # 36 LM layers keep theirs
    assert recomputed.worst.params == plain.worst.params


def test_planner_counts_each_recomputed_block_as_its_input():
    """The first N blocks keep their inputs, the later ones what they keep without recompute: each block more
    recomputed saves the same bytes, down to every block recomputed (which adds one rerun's working set)."""
    from qvl.recipes import activations
    from qvl.recipes.planner import plan_config
    from qvl.recipes.shapes import model_shapes
    from qvl.recipes.split import Workload

    workload = Workload(seq_length=4096, sample_tokens=600, vision_token_fraction=0.6, patches_per_image=1300)

    def activations_of(**options):
        config = get_recipe("qwen2_5_vl_3b_pretrain").fn(seq_length=4096, **options)
        return plan_config(config, gpus=1, workload=workload).worst.activations, config

    none, config = activations_of()
    one, _ = activations_of(vision_recompute=True, vision_recompute_blocks=1)
    two, _ = activations_of(vision_recompute=True, vision_recompute_blocks=2)
    every, _ = activations_of(vision_recompute=True)
    vision = model_shapes(config.model)[1]
    patches = sum(workload.images(vision.spatial_merge_size))
    per_block, _ = activations.hf_tower_bytes_per_patch(vision, compiled=True)  # the target: a CUDA run
    saved = patches * (per_block - 2 * vision.hidden_size)
    assert none - one == pytest.approx(saved) and one - two == pytest.approx(saved)
    assert every == pytest.approx(none - vision.depth * saved + patches * per_block)


def test_a_layout_that_fits_only_with_it_is_told_how_few_blocks_to_recompute():
    from qvl.recipes.planner import plan_recipe

    plan = plan_recipe("qwen2_5_vl_72b_sft", {"vision_recompute": False}, gpus=32)
    assert not plan.fits
    first = plan.suggestions[0]
    assert first.startswith("vision_recompute=true vision_recompute_blocks=")
    blocks = int(first.split("vision_recompute_blocks=")[1].split()[0])
    fewest = {"vision_recompute": True, "vision_recompute_blocks": blocks}
    assert plan_recipe("qwen2_5_vl_72b_sft", fewest, gpus=32, suggest=False).fits
    one_fewer = {"vision_recompute": True, "vision_recompute_blocks": blocks - 1}
    assert not plan_recipe("qwen2_5_vl_72b_sft", one_fewer, gpus=32, suggest=False).fits


@pytest.mark.parametrize(
    "options, message",
    [
        ({"vision_recompute_blocks": 4}, "vision_recompute_blocks=4 needs vision_recompute=true"),
        ({"vision_recompute": True, "vision_recompute_blocks": 0}, r"vision_recompute_blocks=0 .* \(1 to 32\)"),
        ({"vision_recompute": True, "vision_recompute_blocks": 33}, r"vision_recompute_blocks=33 .* \(1 to 32\)"),
    ],
)
def test_a_block_count_without_the_option_or_outside_the_tower_is_refused(options, message):
    from qvl.foundation.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        get_recipe("qwen2_5_vl_3b_pretrain").fn(**options)


def test_qwen3_vl_is_refused_with_the_option_that_recomputes_its_tower(tmp_path, cpu_runtime):
    from qvl.foundation.errors import ConfigError
    from qvl.training.loop import TrainRequest, prepare_config

    request = TrainRequest(
        recipe="qwen3_vl_2b_pretrain", overrides={"vision_recompute": True}, run_dir=tmp_path, model="tiny"
    )
    with pytest.raises(ConfigError, match="recompute=full"):
        prepare_config(request, cpu=True)
    request.recipe, request.run_dir = "qwen2_5_vl_3b_pretrain", tmp_path / "qwen25"  # its own tiny checkpoint
    _, config = prepare_config(request, cpu=True)
    assert config.qvl.vision_recompute
    from transformers import AutoModel

    from qvl.bridges.tiny_model import tiny_hf_config

    tower = AutoModel.from_config(tiny_hf_config("qwen2_5_vl")).visual
    config.model.pre_wrap_hook([torch.nn.ModuleList([tower])])  # what Megatron-Bridge runs on the built model
    assert all(block.gradient_checkpointing for block in tower.blocks)
    request.overrides, request.run_dir = {"vision_recompute": True, "vision_recompute_blocks": 1}, tmp_path / "one"
    _, config = prepare_config(request, cpu=True)
    tower = AutoModel.from_config(tiny_hf_config("qwen2_5_vl")).visual
    config.model.pre_wrap_hook([torch.nn.ModuleList([tower])])
    assert [block.gradient_checkpointing for block in tower.blocks] == [True] + [False] * (len(tower.blocks) - 1)
