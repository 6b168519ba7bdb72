"""A chained optimizer without the member that trains nothing on any rank (patch group "fix-empty-optimizer" of
qvl.foundation.patches).

Megatron-Core 0.19.2's `get_megatron_optimizer` chains two optimizers whenever a model has expert-parallel
parameters: one for the dense parameters, one for the experts' (which reduce over other ranks). Where only adapters on
MoE experts train (`adapter_targets=experts` with `expert_parallel > 1`, or with the experts split otherwise than the
rest), the dense member has no parameter on any rank: a stub whose `optimizer` is None. Training steps skip stubs,
but a checkpoint save of a chain reads every member's param groups (`ChainedOptimizer._synchronize_steps`: "'NoneType'
object has no attribute 'param_groups'"), then their state.

Here a member that is a stub on every rank (one all-reduce when the optimizer is built) leaves the chain, which
Megatron-Core then saves and loads as the one optimizer it is. A member that is a stub on some ranks only (a pipeline
stage without such parameters) stays, as upstream has it, so that every rank's chain has the same members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

GROUP = "fix-empty-optimizer"


def empty_everywhere(members: list[Any]) -> list[bool]:
    """For each member of a chain: whether it is a stub (nothing to train) on every rank of the job."""
    stub = [bool(getattr(member, "is_stub_optimizer", False)) for member in members]
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return stub
    on_cuda = torch.distributed.get_backend() == "nccl"
    flags = torch.tensor(stub, dtype=torch.int32, device=torch.cuda.current_device() if on_cuda else "cpu")
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    return [bool(flag) for flag in flags.tolist()]


def without_empty_members(optimizer: Any) -> Any:
    """`optimizer` (a ChainedOptimizer) without the members that are stubs on every rank; as it is if none is, or if
    nothing would remain."""
    from megatron.core.optimizer import ChainedOptimizer

    members = getattr(optimizer, "chained_optimizers", None)
    if not isinstance(optimizer, ChainedOptimizer) or not members or len(members) < 2:
        return optimizer
    kept = [member for member, empty in zip(members, empty_everywhere(members), strict=True) if not empty]
    if len(kept) in (0, len(members)):
        return optimizer
    return ChainedOptimizer(kept)


def dropping_empty_members(original: Callable) -> Callable:
    """Replacement factory for `get_megatron_optimizer` as Megatron-Bridge's optimizer set-up imports it."""

    @functools.wraps(original)
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        return without_empty_members(original(*args, **kwargs))

    return get_megatron_optimizer
