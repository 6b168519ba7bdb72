"""Layer specs for runs without Transformer Engine: Megatron-Core's local modules plus SDPA attention."""

from __future__ import annotations

from typing import Any

from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from qvl.kernels.varlen_attention import use_sdpa_attention


def local_gpt_layer_spec(config: Any, vp_stage: int | None = None) -> ModuleSpec:
    """Megatron-Core's local GPT layer (dense or MoE) for `config`, with SDPA core attention. A MoE layer is
    Megatron-Core's MoETransformerLayer, as its hybrid models build theirs: eagerly the same layer, whose router and
    combine Megatron-Core's local CUDA graphs can capture apart from its experts (qvl.kernels.speed_cuda_graphs)."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    if config.num_moe_experts:
        spec.module = MoETransformerLayer
    return use_sdpa_attention(spec)


class UngraphedTransformerLayer(TransformerLayer):
    """Megatron-Core's TransformerLayer without a CUDA graph of its own: where the run's layers are graphed
    (qvl.kernels.speed_cuda_graphs) it runs eagerly between the graphed ones. Qwen3.5's dense Gated DeltaNet layers
    are these: flash-linear-attention's kernels launch one program per 64-token chunk of each sub-sequence, so their
    grids follow the pack's lengths (a MoE layer captures only its router and combine, and runs its attention, a Gated
    DeltaNet too, eagerly)."""

    def create_mcore_cudagraph_manager(self, config) -> None:
        return None
