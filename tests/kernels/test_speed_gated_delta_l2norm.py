"""Patch group "speed-gated-delta-l2norm": Megatron-Core's compiled Gated DeltaNet input preparation
(`_prepare_input_for_gated_delta_rule`) stays one graph with torch's l2norm. fla 0.6's l2norm launches through a
`torch.compiler.disable`d dispatch and breaks it in two. On the CPU a disabled function stands in for fla's; the `gpu`
test runs fla's own."""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import replace
from unittest import mock

import pytest
import torch
from megatron.core.ssm.gated_delta_net import common
from torch._dynamo.utils import counters

from qvl.foundation import patches
from qvl.kernels import switch, torch_gated_delta
from qvl.kernels.speed_gated_delta_l2norm import GROUP
from tests.numerics import assert_as_close_as_eager, relative_error

PREPARE = common._GDNBase._prepare_input_for_gated_delta_rule  # under Megatron-Core's jit_fuser
UNCOMPILED = getattr(PREPARE, "_torchdynamo_orig_callable", PREPARE)


def _layer(*, key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> types.SimpleNamespace:
    """What the input preparation reads of a Gated DeltaNet layer (one TP rank, no context parallelism)."""
    return types.SimpleNamespace(
        qk_dim_local_tp=key_heads * key_dim, v_dim_local_tp=value_heads * value_dim, cp_size=1,
        key_head_dim=key_dim, value_head_dim=value_dim, use_qk_l2norm=True,
        num_key_heads=key_heads, num_value_heads=value_heads,
    )  # fmt: skip


def _inputs(layer, tokens: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    width = 2 * layer.qk_dim_local_tp + layer.v_dim_local_tp
    qkv = torch.randn(1, tokens, width, generator=g, device=device, dtype=dtype).requires_grad_()
    gate = torch.randn(1, tokens, layer.num_value_heads, layer.value_head_dim, generator=g, device=device, dtype=dtype)
    return qkv, gate


def _weights(outputs) -> list[torch.Tensor]:
    """Fixed weights for q, k and v: the gradient of qkv is that of their weighted sum."""
    return [torch.randn(t.shape, generator=torch.Generator(t.device).manual_seed(i), device=t.device, dtype=t.dtype)
            for i, t in enumerate(outputs[:3])]  # fmt: skip


def _traced(layer, qkv, gate, backend) -> tuple[Callable, list, list[str], tuple, torch.Tensor]:
    """The region compiled with `backend` (graphs counted) after a reset of Dynamo: the compiled region, its graphs,
    Dynamo's graph breaks, its outputs and the gradient of qkv for `_weights`."""
    graphs: list = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    region = torch.compile(UNCOMPILED, backend=counting)
    out = region(layer, qkv, gate, 1, qkv.shape[1])
    (grad,) = torch.autograd.grad(sum((t * w).sum() for t, w in zip(out[:3], _weights(out))), qkv)
    return region, graphs, list(counters["graph_break"]), out, grad


def _eager_backend(gm, example_inputs):
    return gm.forward


@torch.compiler.disable
def _dispatched_l2norm(x, eps=1e-6):
    """fla 0.6's l2norm as Dynamo sees it: the launch behind `torch.compiler.disable` (fla.backends.dispatch)."""
    return torch_gated_delta.l2norm(x, eps=eps)


def test_the_switch_puts_torch_l2norm_in_only_where_fla_runs():
    qwen35 = switch.Target(device="cuda", fla=True, gated_delta_net=True)
    assert GROUP in switch.training_groups(qwen35)
    assert not switch.is_on("torch-gated-delta", qwen35)  # fla's kernels run: the delta rule is fla's
    for other in ({"device": "cpu"}, {"fla": False}, {"gated_delta_net": False}):
        assert not switch.is_on(GROUP, replace(qwen35, **other)), other  # torch-gated-delta's l2norm there, or none
    assert {d.group: d.on for d in switch.decide(replace(qwen35, gated_delta_net=None))}[GROUP] is None


def test_the_region_is_one_graph_with_the_group_and_breaks_around_a_disabled_l2norm(monkeypatch):
    layer = _layer(key_heads=2, value_heads=4, key_dim=16, value_dim=8)
    qkv, gate = _inputs(layer, tokens=12)
    monkeypatch.setattr(common, "l2norm", _dispatched_l2norm)
    _, graphs, breaks, before, before_grad = _traced(layer, qkv, gate, _eager_backend)
    assert len(graphs) == 2 and any("torch.compiler.disable" in b for b in breaks), (len(graphs), breaks)

    with patches.applied(GROUP):
        assert common.l2norm is torch_gated_delta.l2norm
        _, graphs, breaks, after, after_grad = _traced(layer, qkv, gate, _eager_backend)
    torch._dynamo.reset()
    assert common.l2norm is _dispatched_l2norm  # undone after the block
    assert len(graphs) == 1 and not breaks, (len(graphs), breaks)
    # the same math: q and k unit rows, repeated for the value heads, v and the gate passed on
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and torch.equal(before_grad, after_grad)
    query, key, value = after[:3]
    assert query.shape == (1, 12, 4, 16) and value.shape == (1, 12, 4, 8)
    torch.testing.assert_close(query.norm(dim=-1), torch.ones(1, 12, 4))
    assert torch.equal(query[:, :, 0], query[:, :, 1]) and torch.equal(key[:, :, 2], key[:, :, 3])


def test_the_regions_compile_once_for_every_layer_of_a_model(cpu_runtime):
    """Megatron-Core's `jit_fuser` methods take the layer as an argument: a guard on any attribute that differs from
    layer to layer (its number) would compile them again for each, and past Dynamo's recompile limit (8) the rest
    would run eagerly. Six Gated DeltaNet layers of two tiny Qwen3.5-VL models (numbers 1 to 3), each region: one
    graph."""
    from qvl.foundation import distributed
    from tests.tiny_megatron import tiny_megatron_model

    distributed.init_distributed()
    layers = [
        module
        for seed in (0, 1)
        for module in tiny_megatron_model("qwen3_5_vl", gradient_accumulation_fusion=False, seed=seed)[0].modules()
        if isinstance(module, torch_gated_delta.GatedDeltaNet)
    ]
    assert len(layers) >= 4 and len({layer.layer_number for layer in layers}) > 1
    first, tokens = layers[0], 16
    heads, width = first.num_value_heads, 2 * first.qk_dim_local_tp + first.v_dim_local_tp
    calls = {
        "_prepare_input_for_gated_delta_rule": lambda layer: (
            layer, torch.randn(1, tokens, width), torch.randn(1, tokens, heads, layer.value_head_dim), 1, tokens),
        "_apply_gated_norm": lambda layer: (
            layer, *(torch.randn(tokens * heads, layer.value_head_dim) for _ in range(2))),
        "_compute_g_and_beta": lambda layer: (
            layer, layer.A_log, layer.dt_bias, torch.randn(1, tokens, heads), torch.randn(1, tokens, heads)),
    }  # fmt: skip
    with patches.applied(GROUP):
        for name, arguments in calls.items():
            method = getattr(common._GDNBase, name)
            graphs = []
            torch._dynamo.reset()
            region = torch.compile(getattr(method, "_torchdynamo_orig_callable", method),
                                   backend=lambda gm, _: graphs.append(gm) or gm.forward)  # fmt: skip
            for layer in layers:
                region(*arguments(layer))
            assert len(graphs) == 1, (name, len(graphs))
    torch._dynamo.reset()


def _l2norm_fp64(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _compared(layer, tokens: int, *, dtype, device: str, backend, record) -> dict[str, tuple]:
    """The region compiled with `backend`, with the l2norm the module has ("before") and with the group's ("group"):
    per way, its graphs, Dynamo's breaks and its (q, k, qkv gradient); "truth": those of the fp64 region. Each way's
    norm-wise errors from it and time per forward+backward are recorded (`record(label, value)`)."""
    qkv, gate = _inputs(layer, tokens=tokens, dtype=dtype, device=device)
    truth_qkv = qkv.detach().double().requires_grad_()
    with mock.patch.object(common, "l2norm", _l2norm_fp64):  # the reference: the same math, uncompiled
        truth = UNCOMPILED(layer, truth_qkv, gate.double(), 1, tokens)
    weights = _weights([qkv.new_empty(t.shape) for t in truth[:3]])  # the compiled ways' (same seeds, dtype)
    (truth_grad,) = torch.autograd.grad(sum((t * w.double()).sum() for t, w in zip(truth[:3], weights)), truth_qkv)
    reference = (truth[0].detach(), truth[1].detach(), truth_grad)

    def synchronized() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def measured(label: str) -> tuple[int, list[str], tuple]:
        region, graphs, breaks, out, grad = _traced(layer, qkv, gate, backend)  # compiled at its first call here
        values = (out[0].detach(), out[1].detach(), grad)

        def step() -> None:
            out = region(layer, qkv, gate, 1, tokens)
            torch.autograd.grad(sum((t * w).sum() for t, w in zip(out[:3], weights)), qkv)

        step()  # warm-up
        start = synchronized()
        for _ in range(10):
            step()
        seconds = (synchronized() - start) / 10
        torch._dynamo.reset()
        errors = [relative_error(v, r) for v, r in zip(values, reference)]
        record(label, {"graphs": len(graphs), "relative_errors_q_k_grad": errors,
                       "ms_per_forward_backward": seconds * 1e3})  # fmt: skip
        return len(graphs), breaks, values

    results = {"before": measured("l2norm as imported"), "truth": reference}
    with patches.applied(GROUP):
        results["group"] = measured("torch's l2norm (speed-gated-delta-l2norm)")
    return results


def test_the_fused_region_is_as_close_to_fp64_as_the_broken_one_on_the_cpu(monkeypatch):
    """The `gpu` test's comparison run on the CPU, the disabled stand-in for fla's l2norm, Dynamo's graphs run eagerly."""
    monkeypatch.setattr(common, "l2norm", _dispatched_l2norm)
    recorded = {}
    layer = _layer(key_heads=2, value_heads=4, key_dim=16, value_dim=8)
    results = _compared(layer, 40, dtype=torch.float32, device="cpu", backend=_eager_backend,
                        record=recorded.__setitem__)  # fmt: skip
    assert [results[way][0] for way in ("before", "group")] == [2, 1], results
    for before, group, truth in zip(results["before"][2], results["group"][2], results["truth"], strict=True):
        assert torch.equal(before, group) and 0 < relative_error(group, truth) < 1e-6  # fp32 against fp64
    assert len(recorded) == 2 and all(v["ms_per_forward_backward"] > 0 for v in recorded.values()), recorded


@pytest.mark.gpu
def test_on_cuda_fla_breaks_the_region_and_the_fused_one_is_as_close_to_fp64(record_property):
    """Qwen3.5-VL-9B's Gated DeltaNet widths (16 key heads, 32 value heads, 128 wide), one 4k pack in bf16, compiled
    with Inductor as Megatron-Core's jit_fuser does: with fla's l2norm the region is two graphs around a graph break;
    with the group one graph, its q, k and qkv gradient within bf16 rounding of fp64 and no further from it than fla's
    way (tests.numerics.assert_as_close_as_eager).
    Each way's forward+backward time per call is recorded."""
    pytest.importorskip("fla")
    from torch._inductor.compile_fx import compile_fx

    assert common.l2norm is not None and common.l2norm is not torch_gated_delta.l2norm  # fla's, as imported
    layer = _layer(key_heads=16, value_heads=32, key_dim=128, value_dim=128)
    results = _compared(layer, 4096, dtype=torch.bfloat16, device="cuda", backend=compile_fx, record=record_property)
    (fla_graphs, fla_breaks, fla_values), (graphs, breaks, values) = results["before"], results["group"]
    # on the CPU Dynamo stops at fla's disabled dispatch; on CUDA it may stop before it, at fla's device context
    assert fla_graphs >= 2 and fla_breaks, (fla_graphs, fla_breaks)
    assert graphs == 1 and not breaks, (graphs, breaks)
    for what, fused, fla, truth in zip(("q", "k", "qkv gradient"), values, fla_values, results["truth"], strict=True):
        assert_as_close_as_eager(fused, fla, truth, what=what)
