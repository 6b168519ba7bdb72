"""Qwen3.5-VL's zero-centred RMSNorms (qvl.bridges.qwen3_5_vl): transformers' numerics bit for bit on CPU, one compiled
region where qvl's compiled regions run (within bf16 rounding of fp64 on CUDA, as close as the eager ops), and the
Gated DeltaNet's output norm summing its weight's gradient over the TP group it was built with, nothing on one rank."""

from __future__ import annotations

import types

import pytest
import torch

from qvl.bridges import qwen3_5_vl
from qvl.kernels import compiled
from tests.numerics import assert_as_close_as_eager

WIDTH = 48


def _config(dtype=torch.float32):
    return types.SimpleNamespace(params_dtype=dtype, sequence_parallel=False)


def _norm(cls=qwen3_5_vl.ZeroCenteredRMSNorm, dtype=torch.float32):
    norm = cls(_config(dtype), WIDTH, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    return norm


def test_the_norm_is_transformers_qwen3_5_rms_norm_bit_for_bit():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm, reference = _norm(dtype=torch.bfloat16), Qwen3_5RMSNorm(WIDTH, eps=1e-6).to(torch.bfloat16)
    reference.weight.data.copy_(norm.weight.data)
    x = torch.randn(3, 5, WIDTH, dtype=torch.bfloat16)
    assert torch.equal(norm(x), reference(x))


def test_the_norm_takes_its_compiled_region_where_compiled_regions_run(monkeypatch):
    norm, x = _norm(), torch.randn(7, WIDTH)
    eager = norm(x)
    regions = []
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    monkeypatch.setattr(compiled, "compiled", lambda fn: regions.append(fn.__name__) or fn)
    assert torch.equal(norm(x), eager)
    assert regions == ["zero_centred_rms_norm"]


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(("group", "summed"), [(None, True), (_Group(1), False), (_Group(2), True)])
def test_the_output_norm_sums_its_weight_gradient_over_its_tp_group_only_where_there_is_one(group, summed, monkeypatch):
    """Built before Megatron's groups exist it has none and takes the default one at each call (as upstream's helper
    does); built with a group of one rank it uses its weight as it is (inside Megatron-Core's compiled
    `_apply_gated_norm`, the helper's warning about a missing group broke that region in two)."""
    assert qwen3_5_vl.parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None  # no groups
    monkeypatch.setattr(qwen3_5_vl.parallel_state, "get_tensor_model_parallel_group", lambda **_: group)
    norm = _norm(qwen3_5_vl.GatedDeltaOutNorm)
    calls = []

    def copy_to_region(weight, group=None):
        calls.append(group)
        return weight

    monkeypatch.setattr(qwen3_5_vl, "copy_to_tensor_model_parallel_region", copy_to_region)
    x = torch.randn(7, WIDTH)
    assert torch.equal(norm(x), qwen3_5_vl.zero_centred_rms_norm(x, norm.weight, norm.eps))
    assert calls == ([group] if summed else [])


@pytest.mark.gpu
def test_the_compiled_norm_is_as_close_to_fp64_as_the_eager_one_on_cuda_bf16():
    """Output and both gradients, norm-wise against fp64 (tests/numerics.py), at a Qwen3.5-9B hidden width."""
    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    norm = qwen3_5_vl.ZeroCenteredRMSNorm(_config(torch.bfloat16), 4096).cuda()
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(x.shape, device="cuda", dtype=torch.float64)
    weight64, x64 = norm.weight.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    reference = qwen3_5_vl.zero_centred_rms_norm(x64, weight64, norm.eps)
    reference_grads = torch.autograd.grad((reference * probe).sum(), (x64, weight64))
    eager = qwen3_5_vl.zero_centred_rms_norm(x, norm.weight, norm.eps)
    eager_grads = torch.autograd.grad((eager.double() * probe).sum(), (x, norm.weight))
    fast = norm(x)  # on CUDA with Triton: the compiled region
    fast_grads = torch.autograd.grad((fast.double() * probe).sum(), (x, norm.weight))
    assert_as_close_as_eager(fast, eager, reference, what="output")
    for name, a, b, ref in zip(("input", "weight"), fast_grads, eager_grads, reference_grads):
        assert_as_close_as_eager(a, b, ref, what=f"{name} gradient")
