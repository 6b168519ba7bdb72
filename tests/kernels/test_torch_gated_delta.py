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


def _strong_decay_inputs(total: int, scale: float, seed: int = 3):
    """Inputs with log-decays around -`scale` per token (real Qwen3.5 layers reach ~-18; `_inputs` stays in [-1, 0])."""
    q, k, v, _, beta = _inputs(total, heads=4, dk=16, dv=16, seed=seed)
    decay = -2 * scale * torch.rand(1, total, 4, generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, decay, beta


def _rule_grads(rule, inputs, weight, dtype):
    leaves = [t.to(dtype).clone().requires_grad_(True) for t in inputs]
    (rule(*leaves).double() * weight).sum().backward()
    return [t.grad.double() for t in leaves]


def test_the_recurrence_is_transformers_bit_for_bit_and_restarts_in_every_packed_piece():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _strong_decay_inputs(100, 18.0)
    packed, _ = torch_gated_delta.recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor(CU))
    for (a, b), piece in zip(zip(CU, CU[1:]), _pieces(packed)):
        alone, _ = torch_recurrent_gated_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta)), None, False)
        assert torch.equal(piece, alone)


@pytest.mark.parametrize("scale", [0.5, 18.0])
def test_decay_gate_gradients_at_real_decays_recurrence_exact_chunked_not(scale):
    """At log-decays near -18 per token the chunked rule's gradient of g is ~1e-5 from the fp64 recurrence (and a
    model's gate parameters sum such errors into ~1e-3), the token-by-token recurrence's within fp32 rounding."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    inputs = _strong_decay_inputs(150, scale)
    weight = torch.randn(1, 150, 4, 16, generator=torch.Generator().manual_seed(5)).double()  # not the global RNG
    exact = _rule_grads(lambda *x: torch_recurrent_gated_delta_rule(*x, None, False)[0], inputs, weight, torch.float64)
    chunked = _rule_grads(lambda *x: torch_gated_delta.chunk_gated_delta_rule(*x)[0], inputs, weight, torch.float32)
    recurrent = _rule_grads(
        lambda *x: torch_gated_delta.recurrent_gated_delta_rule(*x)[0], inputs, weight, torch.float32
    )
    error = lambda ours, truth: float((ours - truth).norm() / truth.norm())  # noqa: E731
    for name, ours_c, ours_r, truth in zip(("q", "k", "v", "g", "beta"), chunked, recurrent, exact, strict=True):
        assert error(ours_r, truth) < 5e-7, name
        assert error(ours_c, truth) < 3e-5, name
    assert error(chunked[3], exact[3]) > 5 * error(recurrent[3], exact[3])  # g: the chunked rule's own error


@pytest.mark.gpu
def test_fla_kernels_agree_with_the_torch_kernels_in_bf16_forward_and_backward():
    """On CUDA with flash-linear-attention, the kernels Megatron-Core's GatedDeltaNet takes from it (packed conv,
    l2norm, chunked delta rule with cu_seqlens) against qvl's torch kernels: both within bf16 rounding of the fp64
    recurrence, fla no further from it than the torch kernels (tests/numerics.py), forward and every gradient."""
    pytest.importorskip("fla")
    from fla.modules.convolution import causal_conv1d
    from fla.modules.l2norm import l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from tests.numerics import assert_as_close_as_eager

    device, cu = torch.device("cuda"), torch.tensor([0, 300, 700, 1024], dtype=torch.int32)
    q, k, v, g, beta = (t.to(device) for t in _strong_decay_inputs(1024, 18.0))
    weight = torch.randn(1, 1024, 4, 16, device=device, dtype=torch.float64)

    def run(delta_rule, norm, dtype):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        qn, kn = norm(leaves[0]), norm(leaves[1])
        out, _ = delta_rule(qn, kn, *leaves[2:], cu_seqlens=cu.to(device))
        (out.double() * weight).sum().backward()
        return [out, *(t.grad for t in leaves)]

    exact = run(torch_gated_delta.recurrent_gated_delta_rule, torch_gated_delta.l2norm, torch.float64)
    fla = run(chunk_gated_delta_rule, l2norm, torch.bfloat16)
    torch_kernels = run(torch_gated_delta.chunk_gated_delta_rule, torch_gated_delta.l2norm, torch.bfloat16)
    for name, fast, eager, truth in zip(("out", "q", "k", "v", "g", "beta"), fla, torch_kernels, exact, strict=True):
        assert_as_close_as_eager(fast, eager, truth, what=f"fla chunk_gated_delta_rule {name}", slack=2.0)
    x = torch.randn(1, 1024, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    conv_weight = torch.randn(48, 4, device=device, dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for name, conv, dtype in (("fla", causal_conv1d, torch.bfloat16), ("torch", torch_gated_delta.causal_conv1d,
                                                                       torch.bfloat16), ("exact", torch_gated_delta.causal_conv1d, torch.float64)):  # fmt: skip
        xi, wi = x.detach().to(dtype).requires_grad_(True), conv_weight.detach().to(dtype).requires_grad_(True)
        y, _ = conv(xi, wi, activation="silu", cu_seqlens=cu.to(device))
        y.double().pow(2).sum().backward()
        outs[name] = (y, xi.grad, wi.grad)
    for index, what in enumerate(("out", "x grad", "weight grad")):
        assert_as_close_as_eager(
            outs["fla"][index], outs["torch"][index], outs["exact"][index], what=f"fla conv {what}"
        )
