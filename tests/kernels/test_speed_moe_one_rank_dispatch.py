"""Patch group "speed-moe-one-rank-dispatch": the all-to-all dispatcher's chunk sort returns its input where the order
is the identity (host indices 0, 1, 2, ...), and is upstream's sort otherwise; on one expert-parallel and one
expert-TP rank (dropless) its token counts stay on the device and the host does not wait for them (Qwen3-VL-MoE's
parity and training tests run with it at EP=1, where every sort is the identity, and at EP=2 and TP=2, where none
is and upstream's copies and wait stay)."""

from __future__ import annotations

import torch

from qvl.kernels.speed_moe_one_rank_dispatch import counts_on_device, is_identity, one_rank, skipping_identity


def _upstream():
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    return sort_chunks_by_idxs


def test_an_identity_sort_returns_its_input_and_any_other_is_upstreams(cpu_runtime):
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()
    upstream = _upstream()
    sort = skipping_identity(upstream)
    tokens, probs = torch.arange(12.0).reshape(6, 2), torch.arange(6.0)
    sizes = torch.tensor([2, 0, 3, 1])
    out, out_probs = sort(tokens, sizes, torch.arange(4), probs=probs)
    assert out is tokens and out_probs is probs
    assert torch.equal(out, upstream(tokens, sizes, torch.arange(4), probs=probs)[0])  # upstream's copy, the same
    order = torch.tensor([2, 0, 3, 1])
    got, want = sort(tokens, sizes, order, probs=probs), upstream(tokens, sizes, order, probs=probs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not torch.equal(got[0], tokens)
    assert sort(tokens, sizes, torch.arange(4))[1] is None


def test_only_host_indices_in_order_are_the_identity():
    assert is_identity(torch.arange(5)) and is_identity(torch.arange(1))
    assert not is_identity(torch.tensor([0, 2, 1])) and not is_identity(torch.tensor([1, 2, 3]))
    calls = []
    sort = skipping_identity(lambda *args, **kwargs: calls.append(kwargs) or ("upstream", None))
    assert sort(torch.zeros(2, 1), torch.tensor([1, 1]), torch.arange(2), fused=True)[0] == "upstream"  # TE's kernel
    assert calls == [{"probs": None, "fused": True}]


def test_only_a_dropless_dispatcher_on_one_rank_keeps_its_counts_on_the_device():
    from types import SimpleNamespace

    def dispatcher(ep=1, tp=1, drop_and_pad=False, capacity=None, padding=False):
        config = SimpleNamespace(moe_expert_capacity_factor=capacity, moe_router_padding_for_quantization=padding)
        return SimpleNamespace(ep_size=ep, tp_size=tp, drop_and_pad=drop_and_pad, config=config)

    assert one_rank(dispatcher())
    others = [dispatcher(ep=2), dispatcher(tp=2), dispatcher(drop_and_pad=True, capacity=1.0),
              dispatcher(capacity=1.0), dispatcher(padding=True)]  # fmt: skip
    assert not any(one_rank(d) for d in others)
    calls = []
    upstream = lambda self, point, tokens_per_expert=None: calls.append(point) or "host copy"  # noqa: E731
    counts = torch.tensor([3, 1])
    assert counts_on_device(upstream)(dispatcher(), "before_finish", counts) is counts and calls == []
    assert counts_on_device(upstream)(others[0], "before_finish", counts) == "host copy"
    assert calls == ["before_finish"]


def _census(layer, tokens) -> tuple[int, dict]:
    """(kernel-launching ops, host reads by site) of the layer's forward and backward in the step census (the
    dispatcher's sort indices marked as the host tensors they are, its count copies and wait as CUDA runs them)."""
    from benchmarks.op_costs import WidthMap
    from benchmarks.step_census import Census
    from benchmarks.step_kernels import dispatcher_host_copies

    census = Census(WidthMap(dims={}))
    dispatcher = layer.token_dispatcher
    census.mark_host([dispatcher.sort_input_by_local_experts, dispatcher.restore_output_by_local_experts])
    layer.zero_grad(set_to_none=True)  # each backward makes its gradients (no accumulation into an earlier one's)
    with census.tracking(), census.counted(), dispatcher_host_copies(census):
        layer(tokens)[0].square().sum().backward()
    counts = census.regions[census.region]
    return sum(counts.launches.values()), dict(counts.syncs)


def test_with_grouped_experts_an_moe_layer_at_ep1_reads_nothing_back_to_the_host(cpu_runtime):
    """Qwen3-VL-MoE's tiny MoE layer (the all-to-all dispatcher, one EP rank), forward and backward in the step
    census: upstream copies its token counts to the host and waits for them once (its sorts and the sequential
    experts then read the copies); with speed-grouped-experts and this group nothing is copied or waited for, and the
    output is the same. With this group alone the sequential experts read the counts themselves, once."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from qvl.foundation import distributed, patches
    from qvl.kernels.speed_grouped_experts import grouped_experts
    from tests.tiny_megatron import tiny_megatron_model

    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model("qwen3_vl_moe", gradient_accumulation_fusion=False)
        layer = next(m for m in model.modules() if isinstance(m, MoELayer)).requires_grad_(True)
        tokens = torch.randn(64, 1, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
        upstream_ops, upstream_reads = _census(layer, tokens)
        upstream_out = layer(tokens)[0].detach()
        with patches.applied("speed-moe-one-rank-dispatch"):
            _, sequential_reads = _census(layer, tokens)
            original, SequentialMLP.forward = SequentialMLP.forward, grouped_experts(SequentialMLP.forward)
            try:
                ops, reads = _census(layer, tokens)
                out = layer(tokens)[0].detach()
            finally:
                SequentialMLP.forward = original
    finally:
        distributed.destroy_distributed()
    assert [(site.split(" at ")[0], n) for site, n in upstream_reads.items()] == [("d2h_event.synchronize()", 1)]
    assert "token_dispatcher.py" in next(iter(upstream_reads))
    assert [(site.split(" at ")[0], n) for site, n in sequential_reads.items()] == [(".tolist()", 1)]
    assert reads == {} and ops < upstream_ops, (reads, ops, upstream_ops)
    torch.testing.assert_close(out, upstream_out, rtol=1e-6, atol=1e-6)
