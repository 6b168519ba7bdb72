"""The one-pass optimizer step (patch group "speed-optimizer", qvl.kernels.speed_optimizer): each replacement gives
what Megatron-Core's no-TE/no-Apex fallback gives, with fewer kernels and no host reads."""

from __future__ import annotations

import copy

import pytest
import torch

from qvl.foundation import megatron, patches
from tests.numerics import assert_as_close_as_eager


@pytest.fixture(scope="module")
def fallbacks():
    megatron.import_megatron_bridge()
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    return local_multi_tensor_l2_norm, local_multi_tensor_scale


def _grads(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (48,), (7, 3, 5), (1,), (300,)]
    return [torch.randn(s, generator=generator) * (i + 1) for i, s in enumerate(shapes)]


def test_foreach_norm_equals_the_per_tensor_fallback_bitwise_and_stays_on_the_device(fallbacks, cpu_runtime):
    from qvl.kernels.speed_optimizer import foreach_l2_norm

    upstream, _ = fallbacks
    grads = _grads()
    expected, _ = upstream(2048 * 32, None, [grads], False)
    norm, per_tensor = foreach_l2_norm(upstream)(2048 * 32, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm, expected), (norm, expected)


def test_foreach_scale_equals_the_fallback_in_place_and_out_of_place(fallbacks):
    from qvl.kernels.speed_optimizer import foreach_scale

    _, upstream = fallbacks
    ours, theirs = _grads(1), _grads(1)
    foreach_scale(upstream)(0, None, [ours, ours], 0.37)
    upstream(0, None, [theirs, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    sources = _grads(2)
    ours, theirs = ([torch.empty_like(g) for g in sources] for _ in range(2))
    foreach_scale(upstream)(0, None, [sources, ours], 3.0)
    upstream(0, None, [sources, theirs], 3.0)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_fused_adamw_updates_like_the_foreach_one_within_fp32_rounding():
    from qvl.kernels.speed_optimizer import use_fused_kernel

    params = [torch.nn.Parameter(g.clone()) for g in _grads(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=True)
    assert use_fused_kernel(fused) and all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    for step in range(3):
        for a, b, g in zip(params, twins, _grads(10 + step), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        reference.step()
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = copy.deepcopy(fused.state_dict())
    assert all(s["step"].item() == 3 for s in state["state"].values())


def test_a_differentiable_or_non_float_optimizer_keeps_its_kernels():
    from qvl.kernels.speed_optimizer import use_fused_kernel

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], differentiable=True)
    assert not use_fused_kernel(optimizer)
    assert optimizer.param_groups[0]["fused"] in (None, False)


def test_the_group_replaces_megatron_cores_fallbacks_and_restores_them():
    megatron.import_megatron_bridge()
    from megatron.core.optimizer import clip_grads

    before = clip_grads.l2_norm_impl
    with patches.applied("speed-optimizer"):
        assert clip_grads.l2_norm_impl is not before
        assert clip_grads.l2_norm_impl.__wrapped__ is before  # the foreach norm, wrapping the fallback
    assert clip_grads.l2_norm_impl is before


class _OneRank:
    """A context-parallel group of one rank, as Megatron-Core's rotary asks it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rotary_equals_the_per_subsequence_loop_bitwise_without_host_reads(dtype):
    megatron.import_megatron_bridge()
    from megatron.core.models.common.embeddings import rope_utils

    from qvl.kernels.speed_rotary import mark_whole_pack, packed_rotary

    generator = torch.Generator().manual_seed(0)
    lengths = [5, 17, 1, 9]
    t = torch.randn(sum(lengths), 4, 16, generator=generator).to(dtype)
    freqs = torch.randn(sum(lengths), 1, 1, 16, generator=generator)  # per-token (mRoPE) frequencies
    cu = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32)
    upstream = rope_utils._apply_rotary_pos_emb_thd
    expected = upstream(t, cu, freqs, cp_group=_OneRank())
    fast = packed_rotary(upstream)
    assert torch.equal(fast(t, mark_whole_pack(cu.clone()), freqs, cp_group=_OneRank()), expected)

    reads = []
    original_tolist = torch.Tensor.tolist
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self) or original_tolist(self))
        marked = mark_whole_pack(cu.clone())
        fast(t, marked, freqs, cp_group=_OneRank())
        assert reads == []  # the whole pack in one pass: nothing read back
        fast(t, cu.clone(), freqs, cp_group=_OneRank())  # not marked as a whole pack: upstream's loop
        assert len(reads) == 1


def test_whole_pack_bounds_stay_marked_through_a_copy_or_an_alias_and_nothing_else():
    """Megatron-Core's CUDA graphs hand a shared input buffer to each layer as a detached alias and clone their
    buffers for the warm-up; the bounds are the same, so the mark stays. Any other op gives a plain tensor."""
    from qvl.kernels.speed_rotary import WholePackCuSeqlens, mark_whole_pack

    cu = mark_whole_pack(torch.tensor([0, 5, 8], dtype=torch.int32))
    for alias in (cu.clone(), torch.clone(cu), cu.detach(), torch.clone(cu).detach().requires_grad_(False)):
        assert type(alias) is WholePackCuSeqlens and torch.equal(alias, cu)
    for other in (cu + 1, cu[1:], cu.to(torch.int64), torch.zeros_like(cu), cu.diff()):
        assert type(other) is torch.Tensor


def _rotary_inputs(device: str = "cpu", tokens: int = 32):
    generator = torch.Generator().manual_seed(1)
    t = torch.randn(tokens, 4, 16, generator=generator).to(device, torch.bfloat16)
    freqs = torch.randn(tokens, 1, 1, 16, generator=generator).to(device)
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device=device)
    return t, freqs, cu


def test_packed_rotary_takes_the_compiled_region_where_compiled_regions_run():
    megatron.import_megatron_bridge()
    from megatron.core.models.common.embeddings import rope_utils

    from qvl.kernels import compiled, speed_rotary

    t, freqs, cu = _rotary_inputs()
    calls = []

    def region(*args):
        calls.append(args)
        return speed_rotary.rotary_whole_pack(*args)

    fast = speed_rotary.packed_rotary(rope_utils._apply_rotary_pos_emb_thd)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "runs_compiled", lambda tensor: True)
        patch.setattr(compiled, "compiled", lambda fn: region)
        out = fast(t, speed_rotary.mark_whole_pack(cu.clone()), freqs, mscale=0.5, cp_group=_OneRank())
    assert len(calls) == 1 and calls[0][0] is t and calls[0][1:] == (freqs, False, False, 0.5)
    assert torch.equal(out, fast(t, speed_rotary.mark_whole_pack(cu.clone()), freqs, mscale=0.5, cp_group=_OneRank()))


@pytest.mark.gpu
def test_compiled_lm_rotary_matches_the_eager_rotary_on_cuda_bf16():
    """One compiled region each way on CUDA (cos and sin in the kernel, one bf16 rounding): forward and gradient
    within bf16 rounding of Megatron-Core's eager rotary."""
    megatron.import_megatron_bridge()
    from megatron.core.models.common.embeddings import rope_utils

    from qvl.kernels import compiled, speed_rotary

    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    t, freqs, cu = _rotary_inputs("cuda", tokens=4096)
    fast = speed_rotary.packed_rotary(rope_utils._apply_rotary_pos_emb_thd)
    results = []
    for compiled_path, dtype in ((True, None), (False, None), (False, torch.float64)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiled, "runs_compiled", lambda tensor, on=compiled_path: on)
            x = t.detach().to(dtype or t.dtype).requires_grad_()
            out = fast(x, speed_rotary.mark_whole_pack(cu.clone()), freqs.to(dtype or freqs.dtype), cp_group=_OneRank())
            out.to(dtype or torch.float32).square().sum().backward()
            results.append((out, x.grad))
    (out, grad), (eager_out, eager_grad), (exact_out, exact_grad) = results
    assert_as_close_as_eager(out, eager_out, exact_out, what="rotary output")
    assert_as_close_as_eager(grad, eager_grad, exact_grad, what="rotary gradient")


class _RotaryConfig:
    apply_rope_fusion = False
    rotary_interleaved = False

    def __init__(self, in_fp32: bool):
        self.apply_rotary_pos_emb_in_fp32 = in_fp32


@pytest.mark.parametrize("in_fp32", [False, True], ids=["bf16", "fp32-math"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "bshd"])
def test_qwen3_vl_rotary_region_is_upstreams_rotary_bitwise(in_fp32, packed):
    """The region qvl compiles on CUDA, run eagerly, against Megatron-Bridge's Qwen3-VL rotary; and where compiled
    regions run, the attention's rotary goes through it."""
    megatron.import_megatron_bridge()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import rope

    from qvl.kernels import compiled, speed_rotary

    t, freqs, cu = _rotary_inputs()
    if not packed:
        t = t.unsqueeze(1)  # [s, b=1, heads, dim]
    config = _RotaryConfig(in_fp32)
    cu_seqlens = cu if packed else None
    expected = rope.apply_rotary_pos_emb_absolute(t, freqs, config, cu_seqlens)
    assert torch.equal(speed_rotary.rotary_absolute(t, freqs, False, in_fp32, packed), expected)
    calls = []
    fast = speed_rotary.absolute_rotary(rope.apply_rotary_pos_emb_absolute)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "runs_compiled", lambda tensor: True)
        patch.setattr(compiled, "compiled", lambda fn: lambda *a: calls.append(a) or expected)
        fast(t, freqs, config, cu_seqlens)
    assert len(calls) == 1 and calls[0][2:] == (False, in_fp32, packed)
    assert torch.equal(fast(t, freqs, config, cu_seqlens), expected)  # on CPU: upstream's function


@pytest.mark.gpu
def test_compiled_qwen3_vl_rotary_matches_upstream_on_cuda_bf16():
    megatron.import_megatron_bridge()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import rope

    from qvl.kernels import compiled, speed_rotary

    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    t, freqs, cu = _rotary_inputs("cuda", tokens=4096)
    results = []
    for compiled_path, dtype in ((True, None), (False, None), (False, torch.float64)):
        x = t.detach().to(dtype or t.dtype).requires_grad_()
        if compiled_path:
            out = compiled.compiled(speed_rotary.rotary_absolute)(x, freqs, False, False, True)
        else:
            out = rope.apply_rotary_pos_emb_absolute(x, freqs.to(dtype or freqs.dtype), _RotaryConfig(False), cu)
        out.to(dtype or torch.float32).square().sum().backward()
        results.append((out, x.grad))
    (out, grad), (eager_out, eager_grad), (exact_out, exact_grad) = results
    assert_as_close_as_eager(out, eager_out, exact_out, what="rotary output")
    assert_as_close_as_eager(grad, eager_grad, exact_grad, what="rotary gradient")
