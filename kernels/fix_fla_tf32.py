"""IEEE fp32 arithmetic on CUDA for a run that asks for it (`qvl.exact_fp32=true`, which `qvl verify-training
--precision fp32` sets on CUDA): fp32 products where torch and Triton would round them to TF32.

On Ampere and later GPUs three places round an fp32 product's inputs to TF32 (a 10-bit mantissa, ~5e-4 relative)
unless told otherwise:
- torch's cuDNN convolutions (`torch.backends.cudnn.conv.fp32_precision` is "tf32" by default; its cuBLAS matmuls
  are IEEE by default): the vision towers' patch embedding;
- Triton's `tl.dot` without an explicit precision (`TRITON_F32_DEFAULT`, "tf32" by default): the
  flash-linear-attention kernels of Qwen3.5-VL's Gated DeltaNet;
- fla's gated delta rule, which solves each chunk's triangular system with explicit TF32 dots on those GPUs
  (`fla.ops.gated_delta_rule.chunk_fwd.SOLVE_TRIL_DOT_PRECISION`; patch group `fix-fla-tf32`, applied by the switch).
A parity check in fp32 (gradients within 1e-4) cannot see through that rounding, and an fp32 run that silently gets
TF32 is not what it asked for. `arithmetic()` sets the first two for a block: the switch's `applied_for_training`
(around every training loop and reference pass of such a run, with the group) and the parity check's reference
run. Triton keeps each kernel compiled with the global values it read and refuses to launch it after one of them
changed, so a process applies all three before its first fla launch (the training loop does) and keeps them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

PATCH_GROUP = "fix-fla-tf32"
TRITON_DEFAULT = "TRITON_F32_DEFAULT"  # Triton's precision for an fp32 `tl.dot` that names none


@contextlib.contextmanager
def arithmetic(enabled: bool = True) -> Iterator[None]:
    """IEEE fp32 in torch's matmuls and convolutions and in Triton's default dots for the block (nothing unless
    `enabled`); the previous settings after it."""
    if not enabled:
        yield
        return
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision, os.environ.get(TRITON_DEFAULT))
    matmul.fp32_precision, conv.fp32_precision, os.environ[TRITON_DEFAULT] = "ieee", "ieee", "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved[:2]
        if saved[2] is None:
            os.environ.pop(TRITON_DEFAULT, None)
        else:
            os.environ[TRITON_DEFAULT] = saved[2]


# Replacement factory for patch group "fix-fla-tf32" (qvl.foundation.patches).


def ieee_dots(original):
    import triton.language as tl

    return tl.constexpr("ieee")
