"""The all-to-all token dispatcher on one expert-parallel and one expert-TP rank, without the work that only
spreads tokens over ranks (patch group "speed-moe-one-rank-dispatch" of qvl.foundation.patches).

Megatron-Core's all-to-all token dispatcher (every qvl MoE recipe's) does two things at every layer and micro-batch
that a single rank (a single GPU, or TP/EP = 1 for the experts) needs only because they serve many:
- It sorts the tokens it receives by local expert after the exchange and back before it (`sort_chunks_by_idxs`,
  moe/moe_utils.py). Without TE's fused kernel it splits the tokens at their counts (read on the host) and
  concatenates the chunks in the sorted order. From one rank the order is the identity (`arange`): the sort is a copy
  of every routed token, forward and backward. Here a sort whose indices are the identity (checked on the host, where
  the unfused path keeps them) returns its input as it is; any other sort is upstream's.
- It copies its token counts to the host on a side stream and makes the host wait for them
  (`_maybe_dtoh_and_synchronize`: `d2h_event.synchronize()`) before its sort, for the all-to-all's split sizes and
  for experts that take their counts as a list. On one rank there is no all-to-all and the sort is the identity, so
  the wait stalled the host's launches in every layer for nothing where the experts take their counts on the device
  (qvl.kernels.speed_grouped_experts). Here, on one rank of a dropless dispatcher, the counts stay on the device and
  nothing waits. Experts that read them on the host (Megatron-Core's `SequentialMLP`: `tokens_per_expert.tolist()`)
  wait there instead, as long as before. A capacity factor or the router's padding for quantization (an output size
  read on the host) keeps upstream's copies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

GROUP = "speed-moe-one-rank-dispatch"


def one_rank(dispatcher) -> bool:
    """Whether an all-to-all dispatcher spreads tokens over nothing: one expert-parallel and one expert-TP rank,
    `dropless` (its output size is then the tokens times top-k, known on the host)."""
    return (
        dispatcher.ep_size == 1
        and dispatcher.tp_size == 1
        and not dispatcher.drop_and_pad
        and dropless(dispatcher.config)
    )


def dropless(config) -> bool:
    """Whether MoE layers of `config` (a TransformerConfig or a provider) keep every routed token at the router's
    top-k: no capacity factor and no padding of the routing map for quantization (fp8's older name included)."""
    padded = getattr(config, "moe_router_padding_for_quantization", False) or getattr(
        config, "moe_router_padding_for_fp8", False
    )
    return getattr(config, "moe_expert_capacity_factor", None) is None and not padded


def is_identity(sorted_idxs: torch.Tensor) -> bool:
    """Whether host-side sort indices are 0, 1, 2, ... (a device tensor is never read here)."""
    if sorted_idxs.device.type != "cpu":
        return False
    return torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype))


def skipping_identity(original: Callable) -> Callable:
    """Replacement factory for `sort_chunks_by_idxs` as Megatron-Core's token dispatcher imports it."""

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not fused and is_identity(sorted_idxs):
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    return sort_chunks_by_idxs


def counts_on_device(original: Callable) -> Callable:
    """Replacement factory for `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`: on `one_rank`, the counts
    as they are (on the device) and no wait; else upstream's copies and wait."""

    @functools.wraps(original)
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if one_rank(self):
            return tokens_per_expert
        return original(self, point, tokens_per_expert)

    return _maybe_dtoh_and_synchronize
