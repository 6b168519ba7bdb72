"""Cost: forward FLOPs of the language model per packed sequence and of the vision tower per image.

Conventions (the same as Megatron-Bridge's `training/utils/flop_utils.py`, so a plan's estimate and the
trainer's MFU agree):
- 2 FLOPs per multiply-accumulate; matrix multiplies only (norms, activations, softmax, RoPE are ignored).
- Forward only. Training (forward + backward) is 3x these numbers; recompute adds one more forward.
- Causal attention over a sub-sequence of s tokens costs s^2/2 score and value products per query channel
  (Bridge's `core_attn_seq_factor / 2`); sub-sequences of a THD pack never attend to each other, so a pack
  costs the sum over its sub-sequences: linear terms grow with tokens, attention with the sum of squares.
- Qwen3.5's Gated DeltaNet layers are linear attention: their projections (q, k, v, gate z, beta, alpha in; out),
  the depthwise short convolution over q, k, v and the chunked delta-rule recurrence all grow linearly with the
  tokens (Bridge's `gdn_layer_flops`: 4 state-sized products per value head per token); only the full-attention
  layers have the s^2 term. Their attention's output gate doubles the query projection.
- Multi-token-prediction (MTP) layers add, per token and depth, their eh_proj (2h -> h), three norms, one decoder
  layer of the last layer's kind (full attention) and one more pass through the output layer (Bridge's MTP terms).
- The vision tower attends bidirectionally within one temporal frame of one image (`cu_seqlens` is per frame
  in Qwen2-VL, Qwen2.5-VL and Qwen3-VL); Qwen2.5-VL's windowed blocks attend within windows of
  `window_size` pixels instead, except the `fullatt_block_indexes` blocks.

Why both terms matter (OrchMLLM, arXiv 2503.23830): samples of equal token count differ wildly in their share
of image patches, so data-parallel ranks with equal tokens still get unequal vision and attention work.

Every cost is additive: a sample's cost is its LM cost plus its images' vision cost, and a pack's cost is the
sum of its samples' costs. The vectorised helpers (`lm_flops_per_sequence`, `vision_flops_per_image`,
`sample_flops`) exploit that for millions of samples.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from qvl.foundation.families import FAMILIES


@dataclass(kw_only=True, slots=True, frozen=True)
class LMShape:
    """The language model's dimensions that set its FLOPs (Megatron names)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    gated_mlp: bool = True
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_ffn_hidden_size: int = 0  # a shared expert every token passes (Qwen3.5-MoE)
    kv_channels: int | None = None  # head dim; hidden_size // num_attention_heads when None (Qwen3 sets 128)
    attention_output_gate: bool = False  # Qwen3.5: the query projection also yields a gate, twice as wide
    # Qwen3.5's Gated DeltaNet layers (of num_layers) and their widths
    gated_delta_layers: int = 0
    linear_qk_dim: int = 0  # key heads x key head dim (queries the same)
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    mtp_layers: int = 0  # multi-token-prediction depths trained (each a full-attention layer with the model's MLP)


@dataclass(kw_only=True, slots=True, frozen=True)
class VisionShape:
    """The vision tower's dimensions that set its FLOPs (HF `vision_config` names)."""

    hidden_size: int
    depth: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    in_channels: int = 3
    gated_mlp: bool = False
    window_size: int | None = None  # pixels; Qwen2.5-VL's windowed blocks
    fullatt_block_indexes: tuple[int, ...] = ()
    num_deepstack_mergers: int = 0  # Qwen3-VL: one extra patch merger per deepstack layer


# --- language model -----------------------------------------------------------------------------------------


def attention_projection_flops_per_token(shape: LMShape) -> float:
    """One full-attention layer's projections per token: QKV (the query twice as wide with an output gate), out."""
    h = shape.hidden_size
    head_dim = shape.kv_channels or h // shape.num_attention_heads
    q = head_dim * shape.num_attention_heads
    kv = head_dim * shape.num_query_groups
    return float(2 * (h * ((2 if shape.attention_output_gate else 1) * q + 2 * kv) + q * h))


def gated_delta_flops_per_token(shape: LMShape) -> float:
    """One Gated DeltaNet layer per token (Megatron-Bridge's gdn_layer_flops): in_proj to q, k, v, z, beta and alpha,
    the short convolution over q, k, v, the recurrence (4 state-sized products per value head), out_proj."""
    h, qk, heads = shape.hidden_size, shape.linear_qk_dim, shape.linear_num_value_heads
    v = heads * shape.linear_value_head_dim
    in_proj = h * (2 * qk + 2 * v + 2 * heads)
    conv = shape.linear_conv_kernel * (2 * qk + v)
    recurrence = 4 * heads * shape.linear_value_head_dim**2
    return float(2 * (in_proj + conv + recurrence + v * h))


def mlp_flops_per_token(shape: LMShape) -> float:
    """One layer's MLP per token: dense, or the routed experts a token visits plus a shared expert."""
    h = shape.hidden_size
    expansion = 3 if shape.gated_mlp else 2  # gated: gate + up + down; plain: up + down
    if not shape.num_experts:
        return float(2 * h * shape.ffn_hidden_size * expansion)
    if not shape.moe_router_topk or not shape.moe_ffn_hidden_size:
        raise ValueError(
            f"num_experts={shape.num_experts} needs moe_router_topk and moe_ffn_hidden_size "
            f"(got {shape.moe_router_topk}, {shape.moe_ffn_hidden_size})"
        )
    routed = shape.moe_ffn_hidden_size * shape.moe_router_topk
    return float(2 * h * (routed + shape.moe_shared_ffn_hidden_size) * expansion)


def full_attention_layers(shape: LMShape) -> int:
    """Layers with softmax attention: the decoder's other than Gated DeltaNet, and each MTP depth's."""
    return shape.num_layers - shape.gated_delta_layers + shape.mtp_layers


def lm_flops_by_part(shape: LMShape) -> dict[str, float]:
    """Forward FLOPs per token of each part of the LM (attention projections, Gated DeltaNet, MLP, logits, MTP's
    own projections and norms), the s^2 attention term left out."""
    h = shape.hidden_size
    logits = 2 * h * shape.vocab_size
    mtp_own = 2 * (2 * h * h) + 2 * 3 * h  # eh_proj 2h -> h, enorm + hnorm + final norm (as Bridge counts them)
    return {
        "attention": (shape.num_layers - shape.gated_delta_layers) * attention_projection_flops_per_token(shape),
        "gated_delta": shape.gated_delta_layers * gated_delta_flops_per_token(shape),
        "mlp": shape.num_layers * mlp_flops_per_token(shape),
        "logits": logits,
        "mtp": shape.mtp_layers
        * (mtp_own + attention_projection_flops_per_token(shape) + mlp_flops_per_token(shape) + logits),
    }


def lm_linear_flops_per_token(shape: LMShape) -> float:
    """Forward FLOPs per token of the LM's projections (attention and Gated DeltaNet), MLP (or routed experts),
    logits and MTP layers."""
    return float(sum(lm_flops_by_part(shape).values()))


def lm_attention_flops_per_token_squared(shape: LMShape) -> float:
    """Forward causal-attention FLOPs of a sub-sequence of s tokens, divided by s^2 (full-attention layers only)."""
    head_dim = shape.kv_channels or shape.hidden_size // shape.num_attention_heads
    q = head_dim * shape.num_attention_heads
    # QK^T and attention x V, each 2 * q * s * s/2 FLOPs under the causal mask (Bridge: core_attn_seq_factor / 2).
    return float(full_attention_layers(shape) * 2 * q)


def lm_flops_per_sequence(shape: LMShape, lengths: np.ndarray) -> np.ndarray:
    """Forward FLOPs of each (sub-)sequence in `lengths`, vectorised: a*s + b*s^2."""
    s = np.asarray(lengths, dtype=np.float64)
    return lm_linear_flops_per_token(shape) * s + lm_attention_flops_per_token_squared(shape) * s * s


def lm_flops(shape: LMShape, seq_lengths: Sequence[int]) -> float:
    """Forward FLOPs of one packed sequence made of causal sub-sequences of `seq_lengths` tokens."""
    return float(lm_flops_per_sequence(shape, np.asarray(seq_lengths, dtype=np.int64)).sum())


def decoder_layer_flops(shape: LMShape, seq_lengths: Sequence[int]) -> float:
    """Forward FLOPs of one decoder layer over the sub-sequences, the mean over a hybrid LM's layer kinds (what a
    pipeline stage of n layers costs n times)."""
    decoder = replace(shape, vocab_size=0, mtp_layers=0)
    return lm_flops(decoder, seq_lengths) / shape.num_layers


def head_flops(shape: LMShape, seq_lengths: Sequence[int]) -> float:
    """Forward FLOPs of what follows the decoder on the last pipeline stage: the output layer and the MTP layers."""
    return lm_flops(shape, seq_lengths) - lm_flops(replace(shape, vocab_size=0, mtp_layers=0), seq_lengths)


# --- vision tower -------------------------------------------------------------------------------------------


def _vision_per_patch(shape: VisionShape) -> tuple[float, float, float]:
    """(linear FLOPs per patch, attention FLOPs per patch per attended patch, merger FLOPs per patch)."""
    d = shape.hidden_size
    patch_embed = 2 * shape.in_channels * shape.temporal_patch_size * shape.patch_size**2 * d  # Conv3d, stride = kernel
    block = 2 * 4 * d * d + 2 * d * shape.intermediate_size * (3 if shape.gated_mlp else 2)  # QKV+O, MLP
    attention = 4 * d  # QK^T + attention x V: 2 * 2 * d per (query, key) pair, as in Bridge's vit_flops
    merged = d * shape.spatial_merge_size**2
    merger = 2 * (merged * merged + merged * shape.out_hidden_size) / shape.spatial_merge_size**2
    return patch_embed + shape.depth * block, attention, merger * (1 + shape.num_deepstack_mergers)


def _windowed_blocks(shape: VisionShape) -> int:
    if shape.window_size is None:
        return 0
    return shape.depth - len({i for i in shape.fullatt_block_indexes if 0 <= i < shape.depth})


def _window_units(shape: VisionShape) -> int:
    """Side of a Qwen2.5-VL attention window in merged units (HF's `vit_merger_window_size`)."""
    units = shape.window_size // shape.spatial_merge_size // shape.patch_size
    if units < 1:
        raise ValueError(
            f"window_size={shape.window_size} is smaller than one merged patch "
            f"({shape.spatial_merge_size * shape.patch_size} px); use a multiple of it"
        )
    return units


def _sum_sq_blocks(units: np.ndarray, block: int) -> np.ndarray:
    """Sum of squared block sizes when `units` are cut into blocks of `block` (the last one shorter)."""
    full, rest = np.divmod(units, block)
    return full * block * block + rest * rest


def vision_flops_per_image(shape: VisionShape, grid_thw: np.ndarray) -> np.ndarray:
    """Forward FLOPs of the vision tower for each image/video of `grid_thw` [n, 3] (patches), vectorised.

    Exact windows: an h x w frame is cut into windows of `window_units` merged units per side, the last row and
    column of windows shorter (HF `get_vision_window_index`), so the window term is a product of two sums.
    """
    grid = np.asarray(grid_thw, dtype=np.float64).reshape(-1, 3)
    t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
    patches = t * h * w
    linear, attention, merger = _vision_per_patch(shape)
    windowed = _windowed_blocks(shape)
    full_pairs = t * (h * w) ** 2
    cost = (linear + merger) * patches + attention * (shape.depth - windowed) * full_pairs
    if windowed:
        m, units = shape.spatial_merge_size, _window_units(shape)
        window_pairs = t * m**4 * _sum_sq_blocks(h // m, units) * _sum_sq_blocks(w // m, units)
        cost += attention * windowed * window_pairs
    return cost


def vision_flops(shape: VisionShape, patches_per_image: Sequence[int]) -> float:
    """Forward FLOPs of the vision tower (patch embed, blocks, merger) for single-frame images of these patch counts.

    Without the grid, a windowed block is taken to attend over min(patches, patches per window) per patch,
    exact when the image's merged grid is a multiple of the window; use `vision_flops_per_image` with
    `grid_thw` for the exact figure and for videos.
    """
    n = np.asarray(patches_per_image, dtype=np.float64)
    linear, attention, merger = _vision_per_patch(shape)
    windowed = _windowed_blocks(shape)
    pairs = (shape.depth - windowed) * n * n
    if windowed:
        window_patches = (_window_units(shape) * shape.spatial_merge_size) ** 2
        pairs = pairs + windowed * n * np.minimum(n, window_patches)
    return float(((linear + merger) * n + attention * pairs).sum())


# --- samples and packs --------------------------------------------------------------------------------------


def sample_flops(
    lm: LMShape,
    vision: VisionShape | None,
    lengths: np.ndarray,
    grid_thw: np.ndarray | None = None,
    grid_sample: np.ndarray | None = None,
) -> np.ndarray:
    """Forward FLOPs per sample: LM over its `lengths` tokens plus the vision tower over its images.

    `grid_thw` [n_images, 3] lists every image/video of every sample, and `grid_sample` [n_images] says which
    sample each belongs to.
    """
    cost = lm_flops_per_sequence(lm, lengths)
    if vision is not None and grid_thw is not None and len(grid_thw):
        per_image = vision_flops_per_image(vision, grid_thw)
        cost = cost + np.bincount(np.asarray(grid_sample, np.int64), weights=per_image, minlength=len(cost))
    return cost


def shapes_from_hf_config(config: dict | pathlib.Path) -> tuple[LMShape, VisionShape]:
    """LM and vision shapes from a Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) HF `config.json` (dict or path)."""
    if not isinstance(config, dict):
        path = pathlib.Path(config)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    text = config.get("text_config") or config  # Qwen2-VL / 2.5-VL keep text fields at the top level
    vision = config.get("vision_config")
    if vision is None:
        raise ValueError("config has no vision_config; pass a Qwen-VL checkpoint's config.json")
    return _lm_shape(text), _vision_shape(config.get("model_type", ""), vision)


def _lm_shape(text: dict) -> LMShape:
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in text]
    if missing:
        raise ValueError(f"text config lacks {missing}; is this a Qwen-VL config.json?")
    experts = text.get("num_experts")
    layer_types = text.get("layer_types") or ()
    heads = text.get("linear_num_value_heads", 0)
    return LMShape(
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"],
        num_query_groups=text.get("num_key_value_heads") or text["num_attention_heads"],
        ffn_hidden_size=text.get("intermediate_size", 0),
        vocab_size=text["vocab_size"],
        gated_mlp=True,
        num_experts=experts,
        moe_router_topk=text.get("num_experts_per_tok") if experts else None,
        moe_ffn_hidden_size=text.get("moe_intermediate_size") if experts else None,
        moe_shared_ffn_hidden_size=(text.get("shared_expert_intermediate_size") or 0) if experts else 0,
        kv_channels=text.get("head_dim"),
        # Qwen3.5's hybrid configs (linear-attention `layer_types`) have gated attention; a provider says so itself
        attention_output_gate=text.get("attention_output_gate", "linear_attention" in layer_types),
        gated_delta_layers=sum(kind == "linear_attention" for kind in layer_types),
        linear_qk_dim=text.get("linear_num_key_heads", 0) * text.get("linear_key_head_dim", 0),
        linear_num_value_heads=heads,
        linear_value_head_dim=text.get("linear_value_head_dim", 0),
        linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        mtp_layers=text.get("mtp_num_hidden_layers") or 0,
    )


def _vision_shape(model_type: str, v: dict) -> VisionShape:
    if "embed_dim" in v:  # Qwen2-VL: embed_dim is the ViT width, hidden_size the LM's; plain GELU MLP
        width = v["embed_dim"]
        return VisionShape(
            hidden_size=width,
            depth=v["depth"],
            num_heads=v["num_heads"],
            intermediate_size=int(width * v.get("mlp_ratio", 4)),
            patch_size=v["patch_size"],
            spatial_merge_size=v["spatial_merge_size"],
            temporal_patch_size=v["temporal_patch_size"],
            out_hidden_size=v["hidden_size"],
            in_channels=v.get("in_channels", 3),
        )
    family = FAMILIES.get(model_type)
    gated = family.vision_gated_mlp if family else "window_size" in v
    return VisionShape(
        hidden_size=v["hidden_size"],
        depth=v["depth"],
        num_heads=v["num_heads"],
        intermediate_size=v["intermediate_size"],
        patch_size=v["patch_size"],
        spatial_merge_size=v["spatial_merge_size"],
        temporal_patch_size=v["temporal_patch_size"],
        out_hidden_size=v["out_hidden_size"],
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        gated_mlp=gated,
        window_size=v.get("window_size"),
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
        num_deepstack_mergers=len(v.get("deepstack_visual_indexes", ())),
    )
