"""Patch group "torch-checkpoint-without-output": Megatron-Core's CheckpointWithoutOutput (selective recompute of the
norms, an expert's activation, Gated DeltaNet's output norm) without Transformer Engine."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import megatron, patches
from qvl.kernels.torch_checkpoint_without_output import GROUP

megatron.import_megatron_core()

from megatron.core import tensor_parallel  # noqa: E402


def _norm_recomputed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A norm recomputed as a layer recomputes its input norm: output discarded after its consumer, recomputed from
    the consumer's gradient hook."""
    checkpoint = tensor_parallel.CheckpointWithoutOutput()
    normed = checkpoint.checkpoint(lambda t: torch.nn.functional.rms_norm(t, (t.shape[-1],), weight), x)
    out = (normed * 3.0).sum(-1)
    checkpoint.discard_output_and_register_recompute(out)
    return out


@pytest.mark.skipif(megatron.have_transformer_engine(), reason="the failure is that of a machine without TE")
def test_a_recomputed_norm_runs_without_te_and_gives_the_plain_gradients(cpu_runtime):
    """Upstream reads fp8=False as FP8 on and calls TE's FP8GlobalStateManager (a NameError without TE); with the group
    the norm is checkpointed, recomputed in the backward, and its gradients are the plain forward's."""
    x = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True)
    applied = patches.is_applied(GROUP)  # process-wide once a model was built without TE in this process
    patches.undo(GROUP)
    try:
        with pytest.raises(NameError, match="FP8GlobalStateManager"):
            _norm_recomputed(x, weight)
    finally:
        if applied:
            patches.apply(GROUP)
    with patches.applied(GROUP):
        _norm_recomputed(x, weight).sum().backward()
    recomputed = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    (torch.nn.functional.rms_norm(x, (8,), weight) * 3.0).sum().backward()
    torch.testing.assert_close(recomputed, (x.grad, weight.grad), rtol=0, atol=0)
