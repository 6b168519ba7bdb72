"""Tiny random Qwen-VL checkpoints from shrunk real configs, for tests, the demo and benchmarks (no hub).

Each family keeps its real block structure (Qwen2-VL's LayerNorm/non-gated vision MLP, Qwen2.5-VL's
window attention and full-attention blocks, Qwen3-VL's deepstack and learned vision position
embedding, Qwen3-VL-MoE's experts) at widths of 32-64. Token ids come from the tiny tokenizer of
`qvl.foundation.tiny`, whose special tokens are ids 0-6.
"""

from __future__ import annotations

import pathlib

import torch

from qvl.foundation.tiny import SPECIAL_TOKENS, write_tiny_hf_processor_dir

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VOCAB_SIZE = 512
_TOKEN_IDS = {
    "vision_start_token_id": SPECIAL_TOKENS.index("<|vision_start|>"),
    "vision_end_token_id": SPECIAL_TOKENS.index("<|vision_end|>"),
    "image_token_id": SPECIAL_TOKENS.index("<|image_pad|>"),
    "video_token_id": SPECIAL_TOKENS.index("<|video_pad|>"),
}
# Text model: Qwen2 / Qwen3 blocks at hidden 64, head_dim 16 (so mRoPE sections sum to 8).
_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
    pad_token_id=0,
)


def tiny_hf_config(family: str):
    """The transformers config of a tiny `family` model (architectures set, so AutoBridge accepts it)."""
    import transformers

    if family == "qwen2_vl":
        text = dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        return transformers.Qwen2VLConfig(
            text_config=text, vision_config=vision, **_TOKEN_IDS, architectures=["Qwen2VLForConditionalGeneration"]
        )
    if family == "qwen2_5_vl":
        text = dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1, 3],
            tokens_per_second=2,
        )
        return transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, **_TOKEN_IDS, architectures=["Qwen2_5_VLForConditionalGeneration"]
        )
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        text = dict(_TEXT, head_dim=16, rope_parameters=rope)
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        )
        if family == "qwen3_vl":
            return transformers.Qwen3VLConfig(
                text_config=text, vision_config=vision, **_TOKEN_IDS, architectures=["Qwen3VLForConditionalGeneration"]
            )
        # moe_intermediate_size 24: fused gate_up [E, 64, 48] is not square, so transformers can tell its on-disk
        # layout apart when loading (its Transpose(1, 2, check_dims=True) converter is ambiguous on square tensors).
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
        return transformers.Qwen3VLMoeConfig(
            text_config=text, vision_config=vision, **_TOKEN_IDS, architectures=["Qwen3VLMoeForConditionalGeneration"]
        )
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def write_tiny_hf_checkpoint(
    path: pathlib.Path, family: str, *, seed: int = 0, max_shard_size: str | None = None
) -> pathlib.Path:
    """Write a random tiny `family` model as an HF checkpoint directory with tokenizer and processor files."""
    import transformers

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_hf_config(family), dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to exactly 1 and biases to 0: perturb them so parity tests see them
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    processor_family = "qwen3_vl" if family == "qwen3_vl_moe" else family
    write_tiny_hf_processor_dir(path, processor_family, vocab_size=VOCAB_SIZE)
    return path
