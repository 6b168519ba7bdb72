"""Comparisons of a fast bf16 path with the eager path it replaces, both measured against an fp64 reference.

Element-wise tolerances cannot tell one bf16 rounding from another: a compiled region that keeps its intermediates in
fp32 rounds once where the eager path rounds several times, so single elements near a rounding boundary land one
bf16 step apart (seen on an H100: 7 of 20 million gradient elements). What matters is that the fast path is as close
to the exact result as the path it replaces, by the norm-wise relative error ||x - ref|| / ||ref||.
"""

from __future__ import annotations

import torch

# bf16 keeps 8 significant bits: rounding every element once gives a norm-wise error of about 2^-9 (~2e-3).
BF16_BOUND = 8e-3


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference||, computed in float64."""
    value, reference = value.detach().double(), reference.detach().double()
    return ((value - reference).norm() / reference.norm()).item()


def assert_as_close_as_eager(fast: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, *, what: str,
                             bound: float = BF16_BOUND, slack: float = 1.25) -> None:  # fmt: skip
    """`fast` is within bf16 rounding of the fp64 `reference`, and not further from it than `eager` is (by `slack`)."""
    fast_error, eager_error = relative_error(fast, reference), relative_error(eager, reference)
    assert torch.isfinite(fast).all(), f"{what}: non-finite values"
    assert fast_error <= bound, f"{what}: relative error {fast_error:.2e} from fp64, above {bound:.0e}"
    assert fast_error <= slack * eager_error + 1e-6, (
        f"{what}: relative error {fast_error:.2e} from fp64, the eager path's {eager_error:.2e}"
    )


# fp32 keeps 24 significant bits: sums of the same terms in two orders differ by a few units of 2^-24 of the terms
FP32_ORDER_BOUND = 1e-5


def assert_equal_up_to_summation_order(value: torch.Tensor, reference: torch.Tensor, *, what: str) -> None:
    """fp32 `value` and `reference` are the same sums taken in another order (a GEMM over a subset of rows against one
    over all rows with the rest zero, whose kernels block the sum differently on each CPU): each element within
    FP32_ORDER_BOUND of itself, or of the tensor's largest element where it is a small difference of larger terms."""
    scale = reference.detach().abs().max().item()
    torch.testing.assert_close(
        value, reference, rtol=FP32_ORDER_BOUND, atol=FP32_ORDER_BOUND * scale, msg=lambda m: f"{what}: {m}"
    )
