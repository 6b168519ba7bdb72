"""No chunk sort where the all-to-all token dispatcher's order is already the experts' (patch group
"speed-moe-identity-sort" of qvl.foundation.patches).

Megatron-Core's all-to-all token dispatcher (every qvl MoE recipe's) sorts the tokens it receives by local expert
after the exchange and back before it (`sort_chunks_by_idxs`, moe/moe_utils.py), and without TE's fused kernel it
does so by splitting the tokens at their counts (read to the host: `split_sizes.tolist()`) and concatenating the
chunks in the sorted order. With one expert-parallel and one expert-tensor-parallel rank (a single GPU, or TP/EP = 1
for the experts) the tokens come from one rank only and the order is the identity (`arange`): the sort is a copy of
every routed token, forward and backward, and three host reads per layer. Here a sort whose indices are the identity
(checked on the host, where the unfused path keeps them) returns its input as it is; any other sort is upstream's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

GROUP = "speed-moe-identity-sort"


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
