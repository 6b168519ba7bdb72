"""Layer specs for runs without Transformer Engine: Megatron-Core's local modules plus SDPA attention."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from qvl.kernels.varlen_attention import use_sdpa_attention

logger = logging.getLogger(__name__)


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
    """Megatron-Core's MoETransformerLayer whose attention is a CUDA graph of its own where its MoE block is graphed
    (qvl.kernels.speed_cuda_graphs): a graph per layer holds the input norm, the attention and the residual add, the
    same method (`_forward_attention`) through Megatron-Core's own CudaGraphManager. Not a Gated DeltaNet attention,
    whose kernels' grids follow the pack. The graph is given the pack's bounds without the pad mark the router takes
    (qvl.kernels.fix_moe_pad_tokens.PaddedPack: its position differs from pack to pack, and a graph replays only the
    arguments it captured; attention does not read it).

    Its MoE block is either Megatron-Core 0.19.2's partial graphs (`cuda_graph_modules=[moe_router, moe_preprocess]`:
    the router and the combine captured, the experts eager between them) or, where the run's config asks for it
    (qvl.kernels.moe_block_graphs.WHOLE_MOE) and the layer's first call finds it possible (`eager_block`), one graph
    each way of the whole block (`_graphed_moe`); a layer that cannot takes the partial graphs."""

    def create_mcore_cudagraph_manager(self, config) -> None:
        from megatron.core.transformer.cuda_graphs import CudaGraphManager

        from qvl.kernels.moe_block_graphs import WHOLE_MOE

        if getattr(config, WHOLE_MOE, False):
            self.cudagraph_manager_moe = CudaGraphManager(config, self, function_name="_graphed_moe")
            self.block_checked = False
        else:
            super().create_mcore_cudagraph_manager(config)
        graphed = self.use_partial_cudagraphs or hasattr(self, "cudagraph_manager_moe")
        attention = getattr(self.submodules_config.self_attention, "module", None)
        if graphed and isinstance(attention, type) and not issubclass(attention, GatedDeltaNet):
            self.cudagraph_manager_attention = CudaGraphManager(config, self, function_name="_graphed_attention")

    def _forward_attention(self, *args, packed_seq_params=None, **kwargs):
        if hasattr(self, "cudagraph_manager_attention"):
            packed_seq_params = unmarked_pack(packed_seq_params)
        return self._graphed_attention(*args, packed_seq_params=packed_seq_params, **kwargs)

    def _graphed_attention(self, *args, **kwargs):
        return super()._forward_attention(*args, **kwargs)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        if inference_context is None and self._whole_block(hidden_states):
            from qvl.foundation import patches
            from qvl.kernels import fix_moe_pad_tokens

            if padding_mask is None and patches.is_applied(fix_moe_pad_tokens.GROUP):
                padding_mask = fix_moe_pad_tokens.pad_mask(self, hidden_states, packed_seq_params)
            return self._graphed_moe(hidden_states, padding_mask, getattr(packed_seq_params, "tokens_per_sample", None))
        return super()._forward_mlp(hidden_states, inference_context, padding_mask, packed_seq_params)

    def _whole_block(self, hidden_states) -> bool:
        """Whether this layer's MoE block runs as one graph: asked for, and possible at its first call; a layer where
        it is not takes Megatron-Core's partial graphs from this call on (their managers made before their first
        call, as the record of the graphs' order needs)."""
        if not hasattr(self, "cudagraph_manager_moe"):
            return False
        if not self.block_checked:
            from qvl.kernels.moe_block_graphs import eager_block

            self.block_checked = True
            reason = eager_block(self, hidden_states)
            if reason is not None:
                logger.warning("speed-cuda-graphs: layer %s graphs its router and combine apart: %s",
                               self.layer_number, reason)  # fmt: skip
                del self.cudagraph_manager_moe
                self.transition_cudagraph_scope("partial")
                return False
        return True

    def _graphed_moe(self, hidden_states, padding_mask=None, tokens_per_sample=None):
        """The pre-MLP norm, the MoE block and the residual add, Megatron-Core's eager `_forward_mlp` (the graph's
        function: tensors and numbers in, the pack's bounds not needed)."""
        packed = None if tokens_per_sample is None else PackedSeqParams(tokens_per_sample=tokens_per_sample)
        return super()._forward_mlp(hidden_states, padding_mask=padding_mask, packed_seq_params=packed)


def unmarked_pack(packed_seq_params: Any) -> Any:
    """`packed_seq_params` as Megatron-Core's own PackedSeqParams (a subclass's extra fields dropped); None as is."""
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
