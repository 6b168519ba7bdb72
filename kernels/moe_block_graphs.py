"""A MoE layer's whole MoE block (pre-MLP norm, router, dispatch, experts, combine, residual add) as one CUDA graph
each way, where nothing in it reads back to the host or changes shape from pack to pack (part of patch group
"speed-cuda-graphs", qvl.kernels.speed_cuda_graphs; the layer is qvl.kernels.local_specs.GraphedAttentionMoELayer).

Megatron-Core 0.19.2 captures a MoE layer in training only in part (`cuda_graph_modules=[moe_router,
moe_preprocess]`): the router with the dispatcher's preprocessing, and the combine, two graphs each way, with the
experts between them eager, because an expert takes the tokens routed to it, whose counts the dispatcher reads to
the host. Between the two graphs the host waits for the router's graph to finish (`_router_dtoh_event.synchronize()`
in `MoETransformerLayer._forward_mlp`): in every MoE layer and micro-batch the host stops launching until the GPU has
caught up. The experts then launch eagerly: some seventy kernels per layer and micro-batch with grouped experts
(benchmarks/RESULTS.md, the step census), many more with Megatron-Core's `SequentialMLP`.

On one expert-parallel and one expert-TP rank, dropless, with qvl's grouped experts, the block has fixed shapes and
reads nothing back: the dispatcher's counts stay on the device and its sort is the identity
(qvl.kernels.speed_moe_one_rank_dispatch), every pack gives the router `tokens` x top-k rows
(qvl.kernels.speed_cuda_graphs pads every pack to `seq_length`), and the two grouped GEMMs take the experts' ends on
the device (qvl.kernels.speed_grouped_experts). There the block is one graph each way through Megatron-Core's own
CudaGraphManager, and the host neither waits nor launches the experts. The pack's pad mask (qvl.kernels.
fix_moe_pad_tokens) is made outside the graph and is one of its inputs, as it is of the router's graph.

`whole_moe_blocks` decides it from the run's config when the layers are built (the experts' adapters come later);
`eager_block` checks each layer at its first call, where its experts and the tokens' dtype are known, and a layer
that fails it takes Megatron-Core's partial graphs instead.
"""

from __future__ import annotations

from typing import Any

import torch

from qvl.foundation import patches
from qvl.kernels.speed_moe_one_rank_dispatch import dropless, one_rank

WHOLE_MOE = "qvl_whole_moe"  # the language model config's flag: its MoE layers capture their MoE block whole
GROUPED = "speed-grouped-experts"
ONE_RANK = "speed-moe-one-rank-dispatch"


def whole_moe_blocks(model: Any) -> bool:
    """Whether the MoE layers of `model` (the language model's provider or TransformerConfig, its layers graphed)
    capture their MoE block whole: the all-to-all dispatcher on one expert-parallel and one expert-TP rank, `dropless`
    (what `speed_moe_one_rank_dispatch.one_rank` asks of a dispatcher), no shared experts overlapped on a side stream,
    and both groups that make the block sync-free applied (grouped experts: the run's `grouped_experts=true`)."""
    if not getattr(model, "num_moe_experts", None) or getattr(model, "moe_token_dispatcher_type", None) != "alltoall":
        return False
    expert_tp = getattr(model, "expert_tensor_parallel_size", None) or getattr(model, "tensor_model_parallel_size", 1)
    single = (getattr(model, "expert_model_parallel_size", 1) or 1) == 1 and (expert_tp or 1) == 1
    overlapped = getattr(model, "moe_shared_expert_overlap", False)
    applied = patches.is_applied(GROUPED) and patches.is_applied(ONE_RANK)
    return single and dropless(model) and not overlapped and applied


def eager_block(layer: Any, hidden_states: torch.Tensor) -> str | None:
    """Why the MoE block of `layer` (a MoE layer whose run asked for `whole_moe_blocks`), given `hidden_states`,
    cannot be captured whole; None where it can: its dispatcher is one rank's (`one_rank`), its experts run as grouped
    GEMMs on these tokens (`grouped_parts`: a plain or LoRA linear per expert, aligned widths, the weights' dtype),
    and torch's grouped GEMM takes their ends without reading them (`reads_nothing_back`)."""
    from qvl.kernels.speed_grouped_experts import grouped_parts, reads_nothing_back

    mlp = layer.mlp
    dispatcher, experts = getattr(mlp, "token_dispatcher", None), getattr(mlp, "experts", None)
    if dispatcher is None or not hasattr(dispatcher, "ep_size") or not one_rank(dispatcher):
        return "its token dispatcher spreads tokens over ranks"
    if type(experts).__name__ != "SequentialMLP":
        return f"its experts are {type(experts).__name__}, not Megatron-Core's SequentialMLP"
    probe = hidden_states.new_empty((1, hidden_states.shape[-1]))  # the routed tokens' dtype, width and alignment
    if grouped_parts(experts, probe) is None:
        return "its experts cannot run as grouped GEMMs (speed_grouped_experts.grouped_parts)"
    if not reads_nothing_back(probe):
        return f"torch's grouped GEMM reads the experts' ends to the host at {probe.dtype} on {probe.device}"
    return None
