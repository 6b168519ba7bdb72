"""Megatron-Bridge's Qwen3-VL vision tower (Qwen3-VL, Qwen3.5-VL) with its grid-derived inputs from the host: the
body of qvl's tower subclass's forward (qvl.bridges.qwen3_vl.Qwen3VLVisionModel).

Megatron-Bridge 0.6.2's `Qwen3VLVisionModel.forward` (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/
vision_model.py) reads its device `grid_thw` back to the host on every call: `fast_pos_embed_interpolate` loops over
the grid and reads each corner's indices and weights with `.tolist()`, `rot_pos_emb` reads two maxima with
`.item()` and loops over the grid again, the split sizes of its output are a `.tolist()`, and its packed blocks carry
their longest length as a 0-d device tensor, which qvl's `SDPAttention` turns into an int in every block. The
loader computes all of it on the host per micro-batch (qvl.kernels.tower_inputs.MegatronTowerInputs); qvl's Qwen3-VL
forward (qvl.kernels.speed_qwen3_vl_sync_free.indexed_forward) hands those of the grid it gives the tower to the
tower's forward as its `tower_inputs` argument, and `prepared_tower_forward` runs the same ops on the same values in
the same order, so outputs and gradients are bitwise upstream's (tests/kernels/test_speed_qwen3_vl_tower.py). A pack
with images and videos, which the model re-orders into one grid in token order, gets inputs for that grid from
qvl's step (qvl.kernels.speed_qwen3_vl_sync_free puts the loader's per-kind inputs in that order); a call without
inputs (a re-split for balancing, a path qvl's forward leaves to upstream) runs upstream's forward as before.
"""

from __future__ import annotations

from typing import Any

import torch

from qvl.foundation.errors import QvlError
from qvl.kernels.tower_inputs import MegatronTowerInputs


class TowerInputsMismatch(QvlError, ValueError):
    """Precomputed tower inputs that do not fit the pixels the tower was given."""


def takes_prepared_inputs(tower: torch.nn.Module, tower_inputs: Any, inference_params: Any) -> bool:
    """Whether a tower call given `tower_inputs` runs `prepared_tower_forward`: not for inference, a pipeline input
    tensor, or a tower padded for vision CUDA graphs (no packed blocks: upstream's own path)."""
    return (
        isinstance(tower_inputs, MegatronTowerInputs)
        and inference_params is None
        and tower.input_tensor is None
        and not tower._uses_vision_cuda_graph()
    )


def prepared_tower_forward(
    tower: torch.nn.Module, pixels: torch.Tensor, inputs: MegatronTowerInputs, extra_block_kwargs: dict | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Upstream's `Qwen3VLVisionModel.forward` without CUDA-graph padding, its grid-derived values from `inputs`."""
    patches_given = sum(t * h * w for t, h, w in inputs.grids)
    if patches_given != pixels.size(0):
        raise TowerInputsMismatch(
            f"the vision tower was given {pixels.size(0)} patches but its precomputed inputs are for grids "
            f"{list(inputs.grids)} ({patches_given} patches); compute the tower inputs from the grid the model is given"
        )
    return tower_from_embeddings(
        tower,
        pixels,
        interpolated_pos_embed(tower, inputs),
        rotary_frequencies(tower, inputs),
        inputs.cu_seqlens,
        inputs.max_seqlen,
        extra_block_kwargs,
    )


def tower_from_embeddings(
    tower: torch.nn.Module,
    pixels: torch.Tensor,
    pos_embeds: torch.Tensor,
    frequencies: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    extra_block_kwargs: dict | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The rest of upstream's forward once the grid-derived values are there: the patches embedded plus their
    position embeddings `pos_embeds`, the blocks with the rotary `frequencies` ([patches, dim / 2]) over the packed
    blocks of `cu_seqlens` (the longest `max_seqlen`, a Python int: the attention reads nothing back), the merger.
    Shared by `prepared_tower_forward` and the tower's CUDA graphs (qvl.kernels.tower_graphs)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    hidden_states = tower.patch_embed(pixels)
    hidden_states = hidden_states + pos_embeds
    seq_len = hidden_states.size(0)
    rotary_pos_emb = frequencies.reshape(seq_len, 1, 1, -1).repeat(1, 1, 1, 2)
    blocks = PackedSeqParams(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        qkv_format="thd",
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    hidden_states, deepstack_features = tower.decoder(
        hidden_states=hidden_states[:, None],
        attention_mask=None,
        inference_params=None,
        rotary_pos_emb=rotary_pos_emb,
        packed_seq_params=blocks,
        **(extra_block_kwargs or {}),
    )
    # Upstream then splits the output by grid (sizes read with `.tolist()`) and concatenates the pieces again, in
    # order: the same tensor, so the merger's output is returned as it is.
    return tower.merger(hidden_states), deepstack_features


def interpolated_pos_embed(tower: torch.nn.Module, inputs: MegatronTowerInputs) -> torch.Tensor:
    """Upstream's `fast_pos_embed_interpolate` from precomputed corners and weights: looked up and weighted once per
    grid, then repeated over frames and put in merge-block order, image by image, as upstream does (which keeps the
    embedding gradient's summation order)."""
    table = tower.pos_embed.weight
    weight = inputs.pos_embed_weight.to(device=table.device, dtype=table.dtype)
    pos_embeds = tower.pos_embed(inputs.pos_embed_index) * weight[:, :, None]
    patch_pos_embeds = pos_embeds[0] + pos_embeds[1] + pos_embeds[2] + pos_embeds[3]
    merge = tower.config.spatial_merge_size
    pieces = patch_pos_embeds.split([h * w for _, h, w in inputs.grids])
    return torch.cat([
        piece.repeat(t, 1).view(t, h // merge, merge, w // merge, merge, -1).permute(0, 1, 3, 2, 4, 5).flatten(0, 4)
        for piece, (t, h, w) in zip(pieces, inputs.grids)
    ])  # fmt: skip


def rotary_frequencies(tower: torch.nn.Module, inputs: MegatronTowerInputs) -> torch.Tensor:
    """Upstream's `rot_pos_emb` from precomputed (row, col) position ids and table size."""
    freq_table = tower.rotary_pos_emb(inputs.max_hw)
    return freq_table[inputs.position_ids].flatten(1)


def megatron_vision_towers(model: Any) -> list[torch.nn.Module]:
    """The Megatron-Bridge Qwen3-VL vision towers in a model or a list of model chunks."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.vision_model import Qwen3VLVisionModel

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Qwen3VLVisionModel)]


def fuse_bias_ops(tower: torch.nn.Module) -> bool:
    """Megatron-Core's bias-GELU and bias-dropout-add fusions in Megatron-Bridge's Qwen3-VL vision tower; True if on.

    Megatron-Bridge builds the tower with both off (`get_vision_model_config`: "no swiglu", "no dropout"), so each
    block runs eagerly fc1's bias add and the GELU (two kernels forward, each writing the whole MLP width), and per
    residual its bias add then the add (two more). Megatron-Core's fused bias-GELU is the tanh approximation the
    tower uses (megatron/core/fusions/fused_bias_gelu.py: `x * 0.5 * (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))`,
    its backward the derivative of that formula), which its MLP selects by `activation_func is F.gelu`: each block's
    MLP gets `F.gelu` as that key (the patch mergers keep their own activation, transformers' exact GELU, which qvl's
    Qwen3-VL model sets). The tower's dropout is 0: bias-dropout-add is the bias add and the residual add in one
    kernel. Both are `jit_fuser` regions (torch.compile), so the caller turns them on only where those compile for
    CUDA with Triton (qvl.foundation.megatron.jit_fusions_usable); a tower whose GELU is another one stays as built.
    In fp32 the fused forms differ from the eager ones by rounding; in bf16 the fused GELU adds the bias in fp32."""
    import functools

    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP

    config = tower.config
    activation = config.activation_func
    tanh_gelu = (
        isinstance(activation, functools.partial)
        and activation.func is F.gelu
        and activation.keywords == {"approximate": "tanh"}
        and not activation.args
    )
    if not (tanh_gelu and config.add_bias_linear and not config.gated_linear_unit):
        return False
    config.bias_activation_fusion = True
    config.bias_dropout_fusion = True
    for module in tower.decoder.modules():
        if isinstance(module, MLP):
            module.activation_func = F.gelu  # the key of the fused tanh GELU (`bias_gelu_impl`), see above
    return True
