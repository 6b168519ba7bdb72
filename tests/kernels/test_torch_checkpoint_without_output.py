"""Patch group "torch-checkpoint-without-output": Megatron-Core's CheckpointWithoutOutput (selective recompute of the
norms, an expert's activation, Gated DeltaNet's output norm) without Transformer Engine or a C++ toolchain."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import megatron, patches
from qvl.kernels.torch_checkpoint_without_output import GROUP

megatron.import_megatron_core()

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import random as mcore_random  # noqa: E402


def _norm_recomputed(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp8=False) -> torch.Tensor:
    """A norm recomputed as a layer recomputes its input norm: output discarded after its consumer, recomputed from
    the consumer's gradient hook. The consumer saves a view of the output for its backward (as a linear layer saves
    its input), so the gradients need the recomputed data in the discarded output's storage."""
    checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8)
    normed = checkpoint.checkpoint(lambda t: torch.nn.functional.rms_norm(t, (t.shape[-1],), weight), x)
    out = (normed.view(*x.shape[:-1], 2, -1) * scale).sum((-1, -2))
    checkpoint.discard_output_and_register_recompute(out)
    assert normed.untyped_storage().nbytes() == 0  # discarded: only the recompute can give the gradients
    return out


def _gradients(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs' gradients of `out.sum()`, by `backward` (the checkpoint refuses `torch.autograd.grad`)."""
    for tensor in inputs:
        tensor.grad = None
    out.sum().backward()
    return tuple(tensor.grad for tensor in inputs)


def _plain_gradients(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight)
    return _gradients((normed.view(*x.shape[:-1], 2, -1) * scale).sum((-1, -2)), x, weight, scale)


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen, requires_grad=True) for shape in ((5, 8), (8,), (2, 4)))


@pytest.mark.skipif(megatron.have_transformer_engine(), reason="the failure is that of a machine without TE")
def test_a_recomputed_norm_runs_without_te_and_gives_the_plain_gradients(cpu_runtime):
    """Upstream reads fp8=False as FP8 on and calls TE's FP8GlobalStateManager (a NameError without TE); with the group
    the norm is checkpointed, recomputed in the backward, and its gradients are the plain forward's."""
    x, weight, scale = _inputs()
    applied = patches.is_applied(GROUP)  # process-wide once a model was built without TE in this process
    patches.undo(GROUP)
    try:
        with pytest.raises(NameError, match="FP8GlobalStateManager"):
            _norm_recomputed(x, weight, scale)
    finally:
        if applied:
            patches.apply(GROUP)
    with patches.applied(GROUP):
        recomputed = _gradients(_norm_recomputed(x, weight, scale), x, weight, scale)
    torch.testing.assert_close(recomputed, _plain_gradients(x, weight, scale), rtol=0, atol=0)


def test_the_recompute_needs_no_compiled_extension(cpu_runtime, monkeypatch):
    """Upstream gives the discarded output its recomputed data through a C++ extension that load_inline builds in the
    first backward; on a machine without ninja (or a compiler) that build fails. With the group nothing is built and
    the gradients are the plain forward's, bit for bit."""
    builds = []

    def no_toolchain(**kwargs):
        builds.append(kwargs["name"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(mcore_random, "load_inline", no_toolchain)
    monkeypatch.setattr(mcore_random, "_share_storage_ext", None)  # not built yet, as in a new process
    x, weight, scale = _inputs()
    applied = patches.is_applied(GROUP)
    patches.undo(GROUP)
    try:  # fp8=None: upstream's checkpoint with FP8 off, which passes its forward without TE
        with pytest.raises(RuntimeError, match="Ninja is required"):
            _gradients(_norm_recomputed(x, weight, scale, fp8=None), x, weight, scale)
    finally:
        if applied:
            patches.apply(GROUP)
    assert builds == ["share_storage_ext"]
    with patches.applied(GROUP):
        recomputed = _gradients(_norm_recomputed(x, weight, scale), x, weight, scale)
    assert builds == ["share_storage_ext"]  # nothing built with the group
    torch.testing.assert_close(recomputed, _plain_gradients(x, weight, scale), rtol=0, atol=0)
