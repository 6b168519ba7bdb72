"""Selective recompute without Transformer Engine (patch group "torch-checkpoint-without-output" of
qvl.foundation.patches).

Megatron-Core 0.19.2 recomputes the norms (`recompute_modules` with `layernorm`), an MoE layer's expert activation
(`moe_act`) and a Gated DeltaNet layer's output norm through `tensor_parallel.CheckpointWithoutOutput`, made at each
forward with its default `fp8=False`. Its `__init__` sets `self.fp8 = fp8 is not None`, which is True for False, so
the checkpoint's forward asks Transformer Engine's `FP8GlobalStateManager` whether FP8 is on: without TE that name was
never imported, and the first forward raised `NameError: name 'FP8GlobalStateManager' is not defined`
(`qvl train ... recompute=selective recompute_modules=core_attn,layernorm`). Without TE there is no FP8, so this
group makes every such checkpoint with FP8 off; the recompute itself is upstream's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from qvl.foundation import patches

GROUP = "torch-checkpoint-without-output"


def without_fp8(original: Callable) -> Callable:
    """Replacement factory for `CheckpointWithoutOutput.__init__`: upstream's, then FP8 off."""

    @functools.wraps(original)
    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    return __init__


def provide_checkpoints() -> None:
    """Checkpoints without FP8 for the rest of the process (idempotent; as `torch-sequence-parallel-norm`, from the
    first provider qvl fixes without TE)."""
    patches.apply(GROUP)
