"""The cost model against hand-computed FLOPs for tiny configs, and against torch's FLOP counter on real towers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qvl.foundation.cost import (
    LMShape,
    VisionShape,
    lm_flops,
    lm_flops_per_sequence,
    sample_flops,
    shapes_from_hf_config,
    vision_flops,
    vision_flops_per_image,
)

TINY_LM = LMShape(
    hidden_size=8, num_layers=2, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=16, vocab_size=10
)


def test_lm_flops_by_hand():
    # Per layer per token: QKV 2*8*(8+4+4)=256, O 2*8*8=128, gated MLP 2*8*16*3=768 -> 1152; x2 layers + logits 160.
    linear = 2 * 1152 + 2 * 8 * 10
    # Causal attention per layer: QK^T and AV, each 2 * q_size * s^2/2 -> 2 * 8 * s^2; x2 layers.
    attention = 2 * 2 * 8
    assert lm_flops(TINY_LM, [5]) == linear * 5 + attention * 25
    # A pack costs the sum of its sub-sequences: attention never crosses them.
    assert lm_flops(TINY_LM, [3, 4]) == linear * 7 + attention * (9 + 16)
    assert lm_flops(TINY_LM, [3, 4]) < lm_flops(TINY_LM, [7])
    np.testing.assert_array_equal(
        lm_flops_per_sequence(TINY_LM, np.array([3, 4])), [linear * 3 + attention * 9, linear * 4 + attention * 16]
    )


def test_lm_flops_moe_and_head_dim():
    moe = LMShape(
        hidden_size=8,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=2,
        ffn_hidden_size=0,
        vocab_size=10,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        kv_channels=16,
    )
    # q = kv = 32 channels: QKV 2*8*96=1536, O 2*32*8=512; routed experts 2*8*6*2*3=576; logits 160.
    assert lm_flops(moe, [1]) == 1536 + 512 + 576 + 160 + 2 * 32
    with pytest.raises(ValueError, match="moe_router_topk"):
        lm_flops(
            LMShape(
                hidden_size=8,
                num_layers=1,
                num_attention_heads=2,
                num_query_groups=2,
                ffn_hidden_size=0,
                vocab_size=10,
                num_experts=4,
            ),
            [1],
        )


TINY_VIT = VisionShape(
    hidden_size=4,
    depth=1,
    num_heads=1,
    intermediate_size=8,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=1,
    out_hidden_size=6,
    in_channels=1,
)


def test_vision_flops_by_hand():
    # Per patch: embed 2*1*1*4*4=32; block 2*4*16 + 2*4*8*2 = 256; merger (2*(16*16+16*6))/4 = 176 -> 464.
    # Attention: 4*d = 16 per (query, key) pair within the image.
    n = 8
    assert vision_flops(TINY_VIT, [n]) == 464 * n + 16 * n * n
    assert vision_flops(TINY_VIT, [4, 8]) == 464 * 12 + 16 * (16 + 64)
    assert vision_flops_per_image(TINY_VIT, np.array([[1, 2, 4]]))[0] == vision_flops(TINY_VIT, [8])
    # Frames of a video attend separately (cu_seqlens per frame): 2 frames of 2x4 = 2 * 8^2 pairs.
    assert vision_flops_per_image(TINY_VIT, np.array([[2, 2, 4]]))[0] == 464 * 16 + 16 * 2 * 64


def test_windowed_blocks_by_hand():
    # Window of 4 px = 1 merged unit = 2x2 patches; block 0 windowed, block 1 full.
    vit = VisionShape(
        hidden_size=4,
        depth=2,
        num_heads=1,
        intermediate_size=8,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=1,
        out_hidden_size=6,
        in_channels=1,
        window_size=4,
        fullatt_block_indexes=(1,),
    )
    per_patch = 32 + 2 * 256 + 176
    # 4x6 patches: 2x3 merged units -> 6 windows of 4 patches.
    expected = per_patch * 24 + 16 * (24 * 24 + 6 * 16)
    assert vision_flops_per_image(vit, np.array([[1, 4, 6]]))[0] == expected
    assert vision_flops(vit, [24]) == expected  # the merged grid is a multiple of the window: exact
    with pytest.raises(ValueError, match="window_size"):
        vision_flops(VisionShape(**{**_fields(vit), "window_size": 2}), [4])


def _fields(shape) -> dict:
    return {name: getattr(shape, name) for name in shape.__slots__}


def test_sample_flops_adds_each_samples_images():
    grids = np.array([[1, 2, 4], [1, 4, 4], [1, 2, 2]])
    cost = sample_flops(TINY_LM, TINY_VIT, np.array([5, 6, 7]), grids, np.array([0, 0, 2]))
    vision = vision_flops_per_image(TINY_VIT, grids)
    np.testing.assert_allclose(cost, lm_flops_per_sequence(TINY_LM, [5, 6, 7]) + [vision[0] + vision[1], 0, vision[2]])


def _counted_flops(model, grid: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    pixels = torch.randn(
        int(grid.prod(1).sum()),
        model.config.in_channels * model.config.temporal_patch_size * model.config.patch_size**2,
    )
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(pixels, grid_thw=grid)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_flops_equal_torch_flop_counter_on_tiny_hf_towers(family):
    config, tower = _tiny_tower(family)
    config._attn_implementation = "eager"  # per-window matmuls, which the counter sees
    torch.manual_seed(0)
    model = tower._from_config(config).eval()
    grid = torch.tensor([[1, 6, 10], [2, 4, 4], [1, 2, 2]])
    _, shape = shapes_from_hf_config(
        {
            "model_type": family,
            "vision_config": config.to_dict(),
            "hidden_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vocab_size": 10,
        }
    )
    assert vision_flops_per_image(shape, grid.numpy()).sum() == _counted_flops(model, grid)


def _tiny_tower(family: str):
    """The family record's tiny vision tower: its transformers config and tower class (qvl.bridges.tiny_model)."""
    import importlib

    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.families import get_family

    record = get_family(family)
    modeling = importlib.import_module(f"transformers.models.{record.hf_module}.modeling_{record.hf_module}")
    return tiny_hf_config(family).vision_config, getattr(modeling, record.vision_tower_class)


def test_shapes_from_hf_config_reads_qwen3_moe_text_fields():
    lm, vision = shapes_from_hf_config(
        {
            "model_type": "qwen3_vl_moe",
            "text_config": {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 100,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24,
                "intermediate_size": 128,
            },
            "vision_config": {
                "hidden_size": 32,
                "depth": 2,
                "num_heads": 2,
                "intermediate_size": 64,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 64,
                "deepstack_visual_indexes": [0, 1],
            },
        }
    )
    assert (lm.num_query_groups, lm.kv_channels, lm.num_experts, lm.moe_router_topk, lm.moe_ffn_hidden_size) == (
        2,
        32,
        8,
        2,
        24,
    )
    assert vision.num_deepstack_mergers == 2 and not vision.gated_mlp and vision.window_size is None
