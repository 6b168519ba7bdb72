"""Selective recompute without Transformer Engine or a C++ toolchain (patch group "torch-checkpoint-without-output" of
qvl.foundation.patches).

Megatron-Core 0.19.2 recomputes the norms (`recompute_modules` with `layernorm`), an MoE layer's expert activation
(`moe_act`) and a Gated DeltaNet layer's output norm through `tensor_parallel.CheckpointWithoutOutput`, made at each
forward with its default `fp8=False`. Its `__init__` sets `self.fp8 = fp8 is not None`, which is True for False, so
the checkpoint's forward asks Transformer Engine's `FP8GlobalStateManager` whether FP8 is on: without TE that name was
never imported, and the first forward raised `NameError: name 'FP8GlobalStateManager' is not defined`
(`qvl train ... recompute=selective recompute_modules=core_attn,layernorm`). Without TE there is no FP8, so this
group makes every such checkpoint with FP8 off; the recompute itself is upstream's.

The recompute then gives the discarded output its data back through `share_storage`, a C++ extension that
`_get_share_storage` builds with `torch.utils.cpp_extension.load_inline` in the first backward of every process (ninja
and a C++ compiler on every node; ~22 s on a 2-core machine the first time; its file lock in the extensions folder
makes every later process wait forever once a build was killed: a test here hung on such a lock). The extension points
the output's storage at the recomputed data. This group writes the recomputed bytes into the output's own storage
instead (`copy_into_storage`: one device copy of the output), which every view of it sees just as well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qvl.foundation import patches

GROUP = "torch-checkpoint-without-output"


def without_fp8(original: Callable) -> Callable:
    """Replacement factory for `CheckpointWithoutOutput.__init__`: upstream's, then FP8 off."""

    @functools.wraps(original)
    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    return __init__


def copy_into_storage(output: torch.Tensor, recomputed: torch.Tensor) -> None:
    """`output`'s storage (freed by `resize_(0)` when the checkpoint discarded it) refilled with `recomputed`'s
    storage's bytes, in place: the tensors autograd saved, views of that storage, see them. The extension's result,
    by a copy."""
    storage, source = output.untyped_storage(), recomputed.untyped_storage()
    storage.resize_(source.nbytes())
    storage.copy_(source)


def without_extension(original: Callable) -> Callable:
    """Replacement factory for `megatron.core.tensor_parallel.random._get_share_storage`: `copy_into_storage`, and
    nothing compiled."""

    @functools.wraps(original)
    def _get_share_storage():
        return copy_into_storage

    return _get_share_storage


def provide_checkpoints() -> None:
    """Checkpoints without FP8 for the rest of the process (idempotent; as `torch-sequence-parallel-norm`, from the
    first provider qvl fixes without TE)."""
    patches.apply(GROUP)
