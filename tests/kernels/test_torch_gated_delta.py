"""qvl's torch Gated DeltaNet kernels (qvl.kernels.torch_gated_delta) on packed input: every sub-sequence of a pack gets
what it gets alone (the conv window and the recurrent state restart at each cu_seqlens boundary), and the chunked
delta rule equals transformers' token-by-token recurrence. fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from qvl.kernels import torch_gated_delta

CU = [0, 5, 75, 76, 100]  # a 70-token piece spans two 64-token chunks; a 1-token piece has no history at all


def _inputs(total: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, total, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(1, total, heads, dv, generator=g)
    decay = -torch.rand(1, total, heads, generator=g)  # log decay, as GatedDeltaNet computes it (<= 0)
    beta = torch.rand(1, total, heads, generator=g)
    return torch_gated_delta.l2norm(q), torch_gated_delta.l2norm(k), v, decay, beta


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor[:, a:b] for a, b in zip(CU, CU[1:])]


def test_packed_delta_rule_equals_each_sample_alone_and_transformers_recurrence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs(CU[-1])
    packed, _ = torch_gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor(CU))
    alone = [torch_gated_delta.chunk_gated_delta_rule(*parts)[0] for parts in zip(*map(_pieces, (q, k, v, g, beta)))]
    assert torch.equal(packed, torch.cat(alone, dim=1))
    recurrent = [
        torch_recurrent_gated_delta_rule(*parts, initial_state=None, output_final_state=False)[0]
        for parts in zip(*map(_pieces, (q, k, v, g, beta)))
    ]
    torch.testing.assert_close(packed, torch.cat(recurrent, dim=1), rtol=1e-5, atol=1e-5)
    whole, _ = torch_gated_delta.chunk_gated_delta_rule(q, k, v, g, beta)  # no boundaries: state flows across samples
    assert not torch.allclose(whole[:, CU[1] :], packed[:, CU[1] :], atol=1e-3)


def test_packed_causal_conv_equals_each_sample_alone():
    x = torch.randn(1, CU[-1], 10, generator=torch.Generator().manual_seed(1))
    weight, bias = torch.randn(10, 4), torch.randn(10)
    packed, _ = torch_gated_delta.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=torch.tensor(CU))
    alone = [torch_gated_delta.causal_conv1d(piece, weight, bias, activation="silu")[0] for piece in _pieces(x)]
    assert torch.equal(packed, torch.cat(alone, dim=1))
    # transformers' prefill path for one sample: a padded depthwise conv, cut to the sequence, then SiLU
    conv = torch.nn.functional.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=3, groups=10)[..., : CU[-1]]
    torch.testing.assert_close(
        torch_gated_delta.causal_conv1d(x, weight, bias, "silu")[0], torch.nn.functional.silu(conv).transpose(1, 2)
    )
    whole, _ = torch_gated_delta.causal_conv1d(x, weight, bias, activation="silu")
    assert not torch.allclose(whole[:, CU[1] : CU[1] + 3], packed[:, CU[1] : CU[1] + 3])  # the window leaked


def test_kernels_refuse_what_they_do_not_compute():
    q, k, v, g, beta = _inputs(8)
    with pytest.raises(torch_gated_delta.GatedDeltaError, match=r"cu_seqlens \[0, 3, 7\] does not cut a sequence of 8"):
        torch_gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(torch_gated_delta.GatedDeltaError, match="cached inference"):
        torch_gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    with pytest.raises(torch_gated_delta.GatedDeltaError, match="activation 'relu'"):
        torch_gated_delta.causal_conv1d(torch.zeros(1, 4, 2), torch.zeros(2, 4), activation="relu")


def test_fla_is_used_only_where_it_can_run(monkeypatch):
    from megatron.core.ssm.gated_delta_net import common

    monkeypatch.setattr(common, "HAVE_FLA", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not torch_gated_delta.fla_usable()  # installed without a GPU: its Triton kernels cannot launch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_gated_delta.fla_usable()
    monkeypatch.setattr(common, "HAVE_FLA", False)
    assert not torch_gated_delta.fla_usable()


def test_gradients_equal_transformers_chunked_fallback_and_the_fp64_recurrence():
    """Backward through one sample: the same numbers as transformers' chunked torch fallback (bit for bit), and
    within fp32 rounding of the exact token-by-token recurrence run in fp64."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    inputs, weight = _inputs(150, heads=4, dk=16, dv=16, seed=3), torch.randn(1, 150, 4, 16)

    def grads(rule, dtype):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in inputs]
        (rule(*leaves).double() * weight.double()).sum().backward()
        return [t.grad.double() for t in leaves]

    ours = grads(
        lambda *x: torch_gated_delta.chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True)[0], torch.float32
    )
    theirs = grads(lambda *x: torch_chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True)[0], torch.float32)
    exact = grads(
        lambda *x: torch_recurrent_gated_delta_rule(*x, None, False, use_qk_l2norm_in_kernel=True)[0], torch.float64
    )
    for mine, hf, truth in zip(ours, theirs, exact, strict=True):
        assert torch.equal(mine, hf)
        assert (mine - truth).norm() <= 2e-6 * truth.norm()
