"""Activation memory the planner counts: what an LM layer (attention or Gated DeltaNet) and a vision tower keep
for backward per micro-batch, and the vision share of a first-stage rank's work (qvl.recipes.planner)."""

from __future__ import annotations

from typing import Any

from qvl.foundation.cost import LMShape, VisionShape
from qvl.recipes.shapes import gated_delta_layers, vision_is_megatron
from qvl.recipes.split import StageCosts


def layer_activation_bytes(
    model: Any, lm: LMShape, tokens: float, *, recompute: str | None, modules: list[str]
) -> float:
    """Bytes one LM layer keeps for backward over `tokens` tokens of one micro-batch (bf16, flash attention)."""
    tp = model.tensor_model_parallel_size
    sp = tp if model.sequence_parallel else 1
    h, heads = lm.hidden_size, lm.num_attention_heads
    d = lm.kv_channels or h // heads
    if recompute == "full":
        return tokens * 2 * h / sp  # the layer's input; the rest is rebuilt in backward
    norms = 0 if "layernorm" in modules else 4 * h  # normalized outputs (= linear inputs) of both norms
    per_token = (4 * h + norms) / sp  # + both norms' inputs
    attention = (2 * (heads * d + 2 * lm.num_query_groups * d) + 2 * heads * d) / tp  # Q, K, V; attention out
    attention += 2 * heads * d / tp if getattr(model, "attention_output_gate", False) else 0  # the output gate
    attention += 0 if "core_attn" in modules else 4 * heads / tp  # softmax statistics (fp32)
    delta = gated_delta_layers(model) / model.num_layers  # Qwen3.5: the share of Gated DeltaNet layers
    per_token += (1 - delta) * attention + delta * gated_delta_bytes_per_token(model) / tp
    if "mlp" not in modules:
        if lm.num_experts:
            # routed copies of the token: expert input, fc1 out, activation out; balanced over EP ranks
            f = lm.moe_ffn_hidden_size
            per_token += lm.moe_router_topk * (2 * h + 6 * f) / tp + 4 * lm.num_experts
        else:
            per_token += 6 * lm.ffn_hidden_size / tp  # fc1 out (gate + up), activation out
    return tokens * per_token


def gated_delta_bytes_per_token(model: Any) -> float:
    """Bytes one Gated DeltaNet layer keeps per token for backward, before TP (bf16 activations: the in_proj output,
    the conv output, q and k repeated to the value heads, v, the fp32 decay and beta, the core, norm and gated
    outputs; plus the fp32 recurrent state [value heads, key dim, value dim] that fla's chunked kernel keeps at every
    64-token chunk boundary, spread over the chunk's tokens)."""
    heads_v, dk, dv = model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim
    qk, v = model.linear_num_key_heads * dk, heads_v * dv
    in_proj = 2 * (2 * qk + 2 * v + 2 * heads_v)
    conv = 2 * (2 * qk + v)
    kernel_inputs = 2 * (2 * heads_v * dk + v) + 4 * 2 * heads_v
    outputs = 3 * 2 * v
    state = 4 * heads_v * dk * dv / 64
    return in_proj + conv + kernel_inputs + outputs + state


# What the replicated HF vision towers (Qwen2-VL, Qwen2.5-VL) keep for backward, in bytes per patch, as measured:
# the unique storages a bf16 tower saves for backward (torch.autograd.graph.saved_tensors_hooks, the weights'
# storages left out) with 2 and with 3 blocks (the difference is one block), at the published widths and at half
# the width or half the MLP width, on 784 and 1,984 patches (the same per patch: the bytes are linear in patches).
# Two towers: transformers' eager one (a CPU run, or CUDA without qvl's patch group speed-hf-vision) and the one a
# CUDA run trains, speed-hf-vision's compiled regions (qvl.kernels.speed_hf_vision) with torch's varlen flash kernel.
# Eager, per block:
# - SwiGLU (Qwen2.5-VL): 30 x width + 8 x MLP width + 712, which is 66.5 KB at the published shape;
# - GELU (Qwen2-VL): 22 x width + 6 x MLP width + 712, which is 59.6 KB.
# The 712 bytes are the rotary tables, fp32 cos and sin of head_dim 80. Outside the blocks: 12 (Qwen2.5-VL) or
# 8 (Qwen2-VL) x width, plus the bf16 pixels. Most of it is the fp32 copies the RMSNorm and rotary steps keep.
# Compiled regions, per block: 20 x width (the norms' inputs and outputs, the fused qkv projection's output, which
# flash's saved v keeps whole, the rotated q and k, the attention output) + 6 (SwiGLU: gate, up, their product) or
# 4 (GELU: fc1's output and the GELU's) x MLP width + 4 x heads (flash's fp32 log-sum-exp) + 8 (norm statistics);
# 46.2 KB at either published shape (measured at both, each term told by its tensor's shape). Outside: 8 x width, the
# pixels and the rotary tables (bf16 cos and sin, shared by the blocks). tests/recipes/test_planner.py re-measures the
# eager tower at the published Qwen2.5-VL shape and the compiled one at both families' (the regions compiled for the
# CPU, flash attention's saved tensors stood in).
HF_TOWER_BYTES = {True: (30, 8, 12), False: (22, 6, 8)}  # gated MLP -> bytes per width, per MLP width, outside
HF_TOWER_ROTARY_BYTES = 712
HF_COMPILED_TOWER_BYTES = {True: (20, 6, 8), False: (20, 4, 8)}
HF_COMPILED_TOWER_NORM_STATISTICS = 8


def hf_tower_bytes_per_patch(vision: VisionShape, *, compiled: bool = False) -> tuple[float, float]:
    """(bytes per patch per block, bytes per patch outside the blocks) an HF vision tower keeps for backward;
    `compiled`: with speed-hf-vision's compiled regions (a CUDA run), else transformers' eager tower."""
    pixels = 2 * vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if compiled:
        per_width, per_ffn, outside = HF_COMPILED_TOWER_BYTES[vision.gated_mlp]
        per_block = per_width * vision.hidden_size + per_ffn * vision.intermediate_size
        per_block += 4 * vision.num_heads + HF_COMPILED_TOWER_NORM_STATISTICS
        rotary = 2 * 2 * vision.hidden_size // vision.num_heads
        return per_block, outside * vision.hidden_size + pixels + rotary
    per_width, per_ffn, outside = HF_TOWER_BYTES[vision.gated_mlp]
    per_block = per_width * vision.hidden_size + per_ffn * vision.intermediate_size + HF_TOWER_ROTARY_BYTES
    return per_block, outside * vision.hidden_size + pixels


def vision_activation_bytes(
    model: Any,
    vision: VisionShape,
    vision_patches: float,
    *,
    recompute_blocks: int = 0,
    compiled_tower: bool = False,
) -> float:
    """Bytes the vision tower keeps for backward over `patches` patches of one micro-batch (`compiled_tower`: an HF
    tower with speed-hf-vision's compiled regions). `recompute_blocks` of the HF tower's blocks (the first ones,
    `vision_recompute`) keep their inputs only; while one reruns in backward, every later block has freed what it
    kept, so a rerun's working set adds to the peak only where every block recomputes."""
    if model.freeze_vision_model:
        return 0.0 if model.freeze_vision_projection else vision_patches * 2 * vision.hidden_size  # merger input
    width, ffn = vision.hidden_size, vision.intermediate_size
    if not vision_is_megatron(model):
        per_block, outside = hf_tower_bytes_per_patch(vision, compiled=compiled_tower)
        recomputed = min(recompute_blocks, vision.depth)
        kept = max(vision.depth - recomputed, 1 if recomputed else 0)
        return vision_patches * (2 * width * recomputed + per_block * kept + outside)
    shard = model.tensor_model_parallel_size
    per_patch = 8 * width + (8 * width + (6 if vision.gated_mlp else 4) * ffn) / shard
    if model.recompute_granularity == "full":
        per_patch = 2 * width
    return vision_patches * per_patch * vision.depth


def vision_balance_buffer_bytes(vision: VisionShape, vision_patches: float, tp: int) -> float:
    """Bytes `vision_balance` adds on one stage-0 rank per micro-batch (mean; the busiest rank is within ~1.15x).

    Pixels received for the images it encodes (float32, at most its 1/TP share: images of its own replica
    do not move), its tower output and the send buffer that repeats each row once per TP rank of the image's
    replica (bf16), and the gradients returned in backward (bf16, 1/TP share).
    """
    pixel = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * 4
    rows = vision_patches / tp / vision.spatial_merge_size**2
    return vision_patches / tp * pixel + rows * vision.out_hidden_size * 2 * (1 + tp + 1)


def vision_shares(model: Any, costs: StageCosts, first_stage_layers: int) -> dict[str, float]:
    """Vision share of a stage-0 rank's forward FLOPs per micro-batch, replicated and with vision_balance."""
    tp = model.tensor_model_parallel_size
    lm = costs.layer * first_stage_layers / tp
    replicated = costs.vision / tp if vision_is_megatron(model) else costs.vision
    shares = {"replicated": replicated / (replicated + lm) if replicated + lm else 0.0}
    if not vision_is_megatron(model):  # refused for Megatron towers (qvl.recipes.base)
        balanced = costs.vision / tp
        shares["vision_balance"] = balanced / (balanced + lm) if balanced + lm else 0.0
    return shares
