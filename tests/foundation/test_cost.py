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


# A tiny hybrid (Qwen3.5-style) LM: 4 layers, 3 Gated DeltaNet + 1 gated full attention, one MTP layer.
HYBRID_TEXT = dict(
    hidden_size=8,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=1,
    linear_key_head_dim=2,
    linear_num_value_heads=2,
    linear_value_head_dim=3,
    linear_conv_kernel_dim=4,
    mtp_num_hidden_layers=1,
)
HYBRID_VISION = dict(depth=1, hidden_size=8, num_heads=2, intermediate_size=16, patch_size=2, spatial_merge_size=2,
                     temporal_patch_size=2, out_hidden_size=8)  # fmt: skip


def test_gated_delta_layers_count_as_linear_attention_and_mtp_as_one_more_layer_by_hand():
    lm, _ = shapes_from_hf_config({"text_config": HYBRID_TEXT, "vision_config": HYBRID_VISION})
    assert lm.gated_delta_layers == 3 and lm.attention_output_gate and lm.mtp_layers == 1
    # Gated full attention per token: Q and its gate 2*8*(2*8), K and V 2*8*(2*4), O 2*8*8 -> 512.
    attention = 2 * 8 * 16 + 2 * 8 * 8 + 2 * 8 * 8
    # Gated DeltaNet per token: in_proj 8 -> q 2 + k 2 + v 6 + z 6 + beta 2 + alpha 2 = 20 outputs: 2*8*20 = 320;
    # conv over q, k, v (10 channels) x 4 taps: 2*40 = 80; recurrence 4 state products x 2 heads x 3 x 3: 2*72 = 144;
    # out_proj 6 -> 8: 96. No s^2 term.
    delta = 320 + 80 + 144 + 96
    mlp = 2 * 8 * 16 * 3  # gate, up, down
    logits = 2 * 8 * 10
    # MTP: eh_proj 16 -> 8 (256), three norms (Bridge counts 2 * 3h = 48), one gated attention layer with its MLP,
    # and the output layer once more.
    mtp = 256 + 48 + attention + mlp + logits
    linear = 3 * delta + attention + 4 * mlp + logits + mtp
    # Softmax attention only in the decoder's full-attention layer and the MTP layer: 2 x 2 * q_size (8) per s^2.
    squared = 2 * (2 * 8)
    assert lm_flops(lm, [6]) == linear * 6 + squared * 36
    assert lm_flops(lm, [2, 4]) == linear * 6 + squared * (4 + 16)  # packed samples never attend to each other


def test_a_model_without_mtp_layers_costs_less_by_exactly_their_share():
    with_mtp, _ = shapes_from_hf_config({"text_config": HYBRID_TEXT, "vision_config": HYBRID_VISION})
    without, _ = shapes_from_hf_config(
        {"text_config": {**HYBRID_TEXT, "mtp_num_hidden_layers": 0}, "vision_config": HYBRID_VISION}
    )
    from qvl.foundation.cost import lm_flops_by_part

    share = lm_flops_by_part(with_mtp)["mtp"]
    assert lm_flops(with_mtp, [5]) - lm_flops(without, [5]) == share * 5 + (2 * 8) * 25  # its attention: s^2 term
