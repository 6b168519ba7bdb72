"""The one-pass optimizer step (patch group "fast-optimizer", qvl.recipes.training.optimizer): each replacement gives
what Megatron-Core's no-TE/no-Apex fallback gives, with fewer kernels and no host reads."""

from __future__ import annotations

import copy

import pytest
import torch

from qvl.foundation import megatron, patches


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
    from qvl.recipes.training.optimizer import foreach_l2_norm

    upstream, _ = fallbacks
    grads = _grads()
    expected, _ = upstream(2048 * 32, None, [grads], False)
    norm, per_tensor = foreach_l2_norm(upstream)(2048 * 32, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm, expected), (norm, expected)


def test_foreach_scale_equals_the_fallback_in_place_and_out_of_place(fallbacks):
    from qvl.recipes.training.optimizer import foreach_scale

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
    from qvl.recipes.training.optimizer import use_fused_kernel

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
    from qvl.recipes.training.optimizer import use_fused_kernel

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], differentiable=True)
    assert not use_fused_kernel(optimizer)
    assert optimizer.param_groups[0]["fused"] in (None, False)


def test_the_group_replaces_megatron_cores_fallbacks_and_restores_them():
    megatron.import_megatron_bridge()
    from megatron.core.optimizer import clip_grads

    before = clip_grads.l2_norm_impl
    with patches.applied("fast-optimizer"):
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

    from qvl.recipes.training.fast_lm import mark_whole_pack, packed_rotary

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
