"""Adapters on MoE experts that the tensor-parallel ranks split, with the communication such an expert's linears
leave to the token dispatcher (patch group "fix-expert-adapter-tp" of qvl.foundation.patches).

Where `expert_tensor_parallel_size` > 1 (its default is the TP size), each expert's `linear_fc1` is split by output
columns and its `linear_fc2` by input rows over the expert-TP ranks, and neither linear communicates
(`explicit_expert_comm`): the dispatcher gives every rank all the tokens of its group, and sums the ranks' partial
`linear_fc2` outputs when it combines them. Megatron-Bridge 0.6.2's `ParallelLinearAdapter` builds its two factors
as expert linears too, so they skip their communication as well, and the adapter is then wrong:
- on `linear_fc1`: the bottleneck `h = x A` is whole on every rank and each rank's `B` makes its own output columns,
  so the gradient of `h` is the sum of the ranks' parts; each rank used its own part for `A`'s gradient;
- on `linear_fc2`: each rank's `A` takes its own input rows, so `h` is a partial sum that no one adds up, and each
  rank then gathered `h_r B` column blocks of different ranks' partial `h` into an output that the dispatcher adds up
  again.
At TP=2 with adapters on the experts alone, Qwen3-VL-MoE's LoRA loss left one process's by 0.7% at step 4.

Here an expert adapter split over more than one rank runs as the unsplit adapter would:
- `linear_fc1`: `A` as upstream (its column blocks gathered, so `h` is whole); `B` takes `h` through an identity whose
  backward sums the ranks' gradients (Megatron-Core's `copy_to_tensor_model_parallel_region`);
- `linear_fc2`: `h = sum_r x_r A_r`, summed over the ranks in the forward and its gradient in the backward; each rank
  writes its `h B_r` column block in place in a zero output, so the dispatcher's sum is `h B`.
The factors' shapes, names and checkpoints are upstream's. Adapters of dense linears, and experts whole on each rank,
run upstream's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

GROUP = "fix-expert-adapter-tp"


class _SummedBothWays(torch.autograd.Function):
    """Sum over `group` in the forward, and the gradient's sum over `group` in the backward: a partial sum every rank
    then uses whole (each rank's use adds its own part to the gradient)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        whole = partial.clone()
        torch.distributed.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def summed_both_ways(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """`partial` summed over `group`, and its gradient too (see `_SummedBothWays`)."""
    return _SummedBothWays.apply(partial, group)


def split_over_ranks(adapter: Any) -> int:
    """The number of expert-TP ranks that split `adapter`'s factors (1: an adapter of a dense linear, or an expert
    whole on each rank)."""
    group = getattr(adapter, "tp_group", None)
    if not getattr(adapter, "is_expert", False) or group is None:
        return 1
    return torch.distributed.get_world_size(group)


def column_block(block: torch.Tensor, *, rank: int, ranks: int) -> torch.Tensor:
    """`block` (this rank's columns of the output) at its place in a zero tensor of all the ranks' columns."""
    width = block.shape[-1]
    return F.pad(block, (rank * width, (ranks - 1 - rank) * width))


def split_product(adapter: Any, x: torch.Tensor, first: Callable, second: Callable) -> torch.Tensor:
    """An adapter's low-rank product `second(activation(first(x)))` with the communication the unsplit product
    implies where the expert-TP ranks split its factors (see the module text): `first(v)` gives this rank's
    bottleneck (linear_fc1: its columns; linear_fc2: its partial sum over its input rows), `second(h)` this rank's
    output columns. The per-expert forward here and the grouped one (qvl.kernels.speed_grouped_experts) share it."""
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    group, ranks = adapter.tp_group, split_over_ranks(adapter)
    h = first(x)
    if ranks > 1 and adapter.input_is_parallel:
        h = summed_both_ways(h, group)
    elif ranks > 1:  # the columns gathered; the gradient of the whole summed over the ranks' output columns
        h = copy_to_tensor_model_parallel_region(gather_from_tensor_model_parallel_region(h, group=group), group=group)
    out = second(adapter.activation(h))
    if ranks > 1 and adapter.input_is_parallel:
        out = column_block(out, rank=torch.distributed.get_rank(group), ranks=ranks)
    return out


def _expert_forward(adapter: Any, x: torch.Tensor) -> torch.Tensor:
    """`ParallelLinearAdapter.forward` of an expert adapter split over the expert-TP ranks (see the module text)."""
    if adapter.dropout_position == "pre":
        x = adapter.dropout(x)
    if adapter.input_is_parallel:  # a row-parallel factor: its partial sum, not reduced (explicit expert comm)
        first = lambda v: adapter.linear_in(v)[0]  # noqa: E731
    else:  # this rank's columns, not gathered
        first = lambda v: adapter.linear_in(v, runtime_gather_output=False)[0]  # noqa: E731
    out = split_product(adapter, x, first, lambda h: adapter.linear_out(h, runtime_gather_output=False)[0])
    if adapter.dropout_position == "post":
        out = adapter.dropout(out)
    return out * (adapter.alpha / adapter.dim)


def summed_over_expert_ranks(original: Callable) -> Callable:
    """Replacement factory for `ParallelLinearAdapter.forward`: an expert adapter split over several expert-TP ranks
    runs `_expert_forward`; every other adapter, upstream's forward."""

    @functools.wraps(original)
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if split_over_ranks(self) == 1:
            return original(self, x, *args, **kwargs)
        return _expert_forward(self, x)

    return forward
