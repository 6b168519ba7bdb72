"""Patch group "torch-sequence-parallel-norm": Megatron-Core's torch norm built under sequence parallelism, its
weights marked for the TP-group gradient sum (what TE's norms do); upstream refuses the config. TP=2 training with
it matches transformers' step in tests/training/test_parity_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qvl.foundation import patches
from qvl.kernels.torch_sequence_parallel_norm import GROUP


def _config(*, sequence_parallel: bool) -> SimpleNamespace:
    return SimpleNamespace(
        sequence_parallel=sequence_parallel,
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )


def test_upstream_refuses_a_sequence_parallel_norm():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    applied = patches.is_applied(GROUP)  # a model built earlier in this process applies it for the process
    patches.undo(GROUP)
    try:
        with pytest.raises(AssertionError, match="sequence parallel"):
            WrappedTorchNorm(config=_config(sequence_parallel=True), hidden_size=8)
    finally:
        if applied:
            patches.apply(GROUP)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_norm_is_torchs_with_its_weight_marked_for_the_tp_sum(sequence_parallel):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with patches.applied(GROUP):
        norm = WrappedTorchNorm(config=_config(sequence_parallel=sequence_parallel), hidden_size=8, eps=1e-6)
    assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6 and norm.weight.shape == (8,)
    assert getattr(norm.weight, "sequence_parallel", False) is sequence_parallel


def test_other_refusals_stay():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(sequence_parallel=True)
    config.persist_layer_norm = True
    with patches.applied(GROUP), pytest.raises(AssertionError, match="persist_layer_norm"):
        WrappedTorchNorm(config=config, hidden_size=8)
