"""Layer specs for runs without Transformer Engine: Megatron-Core's local modules plus SDPA attention."""

from __future__ import annotations

import dataclasses
from typing import Any

from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from qvl.kernels.varlen_attention import use_sdpa_attention


def local_gpt_layer_spec(config: Any, vp_stage: int | None = None) -> ModuleSpec:
    """Megatron-Core's local GPT layer (dense or MoE) for `config`, with SDPA core attention. A MoE layer is a
    `GraphedAttentionMoELayer` (Megatron-Core's MoETransformerLayer, as its hybrid models build theirs): eagerly the same
    layer, whose attention, router and combine CUDA graphs can capture apart from its experts
    (qvl.kernels.speed_cuda_graphs)."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    if config.num_moe_experts:
        spec.module = GraphedAttentionMoELayer
    return use_sdpa_attention(spec)


class GraphedAttentionMoELayer(MoETransformerLayer):
    """Megatron-Core's MoETransformerLayer whose attention is a CUDA graph of its own where its router and combine are
    (Megatron-Core 0.19.2's partial graphs, `cuda_graph_modules=[moe_router, moe_preprocess]`, capture those two and
    run the rest eagerly): a third graph per layer holds the input norm, the attention and the residual add, the same
    method (`_forward_attention`) through Megatron-Core's own CudaGraphManager, as the router's is. Not a Gated
    DeltaNet attention, whose kernels' grids follow the pack. The graph is given the pack's bounds without the pad
    mark the router takes (qvl.kernels.fix_moe_pad_tokens.PaddedPack: its position differs from pack to pack, and a
    graph replays only the arguments it captured; attention does not read it)."""

    def create_mcore_cudagraph_manager(self, config) -> None:
        super().create_mcore_cudagraph_manager(config)
        attention = getattr(self.submodules_config.self_attention, "module", None)
        if self.use_partial_cudagraphs and isinstance(attention, type) and not issubclass(attention, GatedDeltaNet):
            from megatron.core.transformer.cuda_graphs import CudaGraphManager

            self.cudagraph_manager_attention = CudaGraphManager(config, self, function_name="_graphed_attention")

    def _forward_attention(self, *args, packed_seq_params=None, **kwargs):
        if hasattr(self, "cudagraph_manager_attention"):
            packed_seq_params = unmarked_pack(packed_seq_params)
        return self._graphed_attention(*args, packed_seq_params=packed_seq_params, **kwargs)

    def _graphed_attention(self, *args, **kwargs):
        return super()._forward_attention(*args, **kwargs)


def unmarked_pack(packed_seq_params: Any) -> Any:
    """`packed_seq_params` as Megatron-Core's own PackedSeqParams (a subclass's extra fields dropped); None as is."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if packed_seq_params is None or type(packed_seq_params) is PackedSeqParams:
        return packed_seq_params
    fields = {f.name: getattr(packed_seq_params, f.name) for f in dataclasses.fields(PackedSeqParams) if f.init}
    return PackedSeqParams(**fields)


class GraphedMLPLayer(TransformerLayer):
    """Megatron-Core's dense TransformerLayer whose attention runs eagerly where the run's layers are graphed
    (qvl.kernels.speed_cuda_graphs), and whose MLP is a CUDA graph of its own each way: the pre-MLP norm, the MLP and
    the residual add (`_forward_mlp`), through Megatron-Core's CudaGraphManager as a MoE layer's router is. Qwen3.5's
    dense Gated DeltaNet layers are these: flash-linear-attention's kernels launch one program per 64-token chunk of
    each sub-sequence, so their grids follow the pack's lengths (a MoE layer, `GraphedAttentionMoELayer`, captures its
    router and combine and runs a Gated DeltaNet attention eagerly). The graph takes the hidden states alone: a dense
    MLP reads neither the pack's bounds nor a padding mask's batch layout."""

    def create_mcore_cudagraph_manager(self, config) -> None:
        from megatron.core.transformer.cuda_graphs import CudaGraphManager

        self.cudagraph_manager_mlp = CudaGraphManager(config, self, function_name="_graphed_mlp")

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        return self._graphed_mlp(hidden_states, inference_context, padding_mask)

    def _graphed_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask)
