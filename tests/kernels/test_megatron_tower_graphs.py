"""Megatron-Bridge's Qwen3-VL vision tower (Qwen3-VL, Qwen3.5-VL) replayed as CUDA graphs at bucketed shapes
(qvl.kernels.tower_graphs.MegatronTowerGraphs). On the CPU every call of a bucket gives the tower's rows, deepstack
features and gradients through `EagerReplay`; a graphed call launches what the step census counts for it."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from qvl.kernels import tower_graphs
from qvl.kernels.tower_buckets import TowerBucket
from qvl.kernels.tower_inputs import tower_inputs_for_config
from tests.kernels.test_speed_hf_vision import tiny_tower
from tests.kernels.test_speed_qwen3_vl_tower import tower  # noqa: F401  (the tiny Qwen3-VL Megatron tower)
from tests.kernels.test_tower_graphs import _Launches, _main_grads

# Two calls of one bucket (208 and 196 rows, a three-frame video in each), then one of another (32 rows).
MEGATRON_CALLS = (
    torch.tensor([[1, 8, 12], [1, 4, 4], [3, 4, 8]]),
    torch.tensor([[1, 8, 12], [1, 2, 2], [3, 4, 8]]),
    torch.tensor([[1, 8, 12], [1, 4, 4], [3, 4, 8]]),
    torch.tensor([[1, 4, 8]]),
)


def _megatron_call(tower, grid: torch.Tensor, seed: int):
    config = tower.config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
    return pixels, tower_inputs_for_config(grid, config), generator


def _megatron_loss(outputs, generator_seed: int) -> torch.Tensor:
    """A loss on the embeddings and every deepstack feature, with fixed random weights (the same for both paths)."""
    embeds, deepstack = outputs
    generator = torch.Generator().manual_seed(generator_seed)
    return sum((t.float() * torch.randn(t.shape, generator=generator)).sum() for t in (embeds, *deepstack))


@contextlib.contextmanager
def _megatron_ddp_like(tower):
    """`main_grad`s and Megatron DDP's hook on the tower's parameters while inside; removed after."""
    handles = _main_grads(tower)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for param in tower.parameters():
            del param.main_grad, param.grad_added_to_main_grad


@contextlib.contextmanager
def _fused_linears(tower, fused: bool):
    """The tower's linears with `gradient_accumulation_fusion` as training builds them (`fused`: their weight
    gradients into `main_grad` inside the GEMM) while inside; as built after."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    linears = [m for m in tower.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    built = [linear.gradient_accumulation_fusion for linear in linears]
    for linear in linears:
        linear.gradient_accumulation_fusion = fused
    try:
        yield
    finally:
        for linear, flag in zip(linears, built, strict=True):
            linear.gradient_accumulation_fusion = flag


@pytest.mark.parametrize("fused", [False, True], ids=["autograd-wgrad", "wgrad-into-main-grad"])
def test_every_call_of_a_qwen3_vl_bucket_gives_the_towers_rows_deepstack_and_gradients(tower, fused):
    """Megatron-Bridge's Qwen3-VL tower (qvl's prepared forward) against its graphs on the CPU (`EagerReplay`): each
    call's embeddings and deepstack features, and the sum of the calls' gradients in `main_grad`, are the eager
    tower's (to rounding: the position table's gradient sums a video's frames in another order); with the linears'
    weight gradients going into `main_grad` in their GEMMs (training's build) or through autograd."""
    from qvl.kernels.tower_graphs import MegatronTowerGraphs

    params = dict(tower.named_parameters())
    expected = {name: torch.zeros_like(p) for name, p in params.items()}
    wants = []
    for index, grid in enumerate(MEGATRON_CALLS):
        pixels, inputs, _ = _megatron_call(tower, grid, seed=index)
        embeds, deepstack = tower(hidden_states=pixels, grid_thw=grid, tower_inputs=inputs)
        grads = torch.autograd.grad(_megatron_loss((embeds, deepstack), index), list(params.values()))
        for name, grad in zip(params, grads, strict=True):
            expected[name] += grad
        wants.append((embeds.detach(), [d.detach() for d in deepstack]))
    with _megatron_ddp_like(tower), _fused_linears(tower, fused):
        graphs = MegatronTowerGraphs(tower, cuda=False)
        for index, grid in enumerate(MEGATRON_CALLS):
            pixels, inputs, _ = _megatron_call(tower, grid, seed=index)
            embeds, deepstack = graphs(pixels, inputs, grid)
            want_embeds, want_deepstack = wants[index]
            assert embeds.shape == want_embeds.shape and len(deepstack) == len(want_deepstack) > 0
            torch.testing.assert_close(embeds, want_embeds, rtol=1e-5, atol=1e-5, msg=f"call {index + 1}")
            for got, want in zip(deepstack, want_deepstack, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"call {index + 1} deepstack")
            _megatron_loss((embeds, deepstack), index).backward()
        assert [b.bucket.patches for b in graphs.buckets.values()] == [208, 32]
        assert graphs.stats()["calls"] == {"warm-up": 2, "captured": 1, "replayed": 1}, graphs.stats()
        weights = [m.weight for m in tower.modules() if hasattr(m, "gradient_accumulation_fusion")]
        assert weights and all(w.grad_added_to_main_grad == fused for w in weights)  # the path each took
        for name, param in params.items():
            assert param.grad is None
            scale = float(expected[name].abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_a_qwen3_vl_bucket_pads_with_rows_of_their_own_and_takes_corners_per_patch(tower):
    """196 rows in the bucket of 208: the corners and weights gathered per patch in the tower's order (a video's
    frames repeat its grid's), the pad rows at the table's first row with weight 0 in one block of their own."""
    from qvl.kernels import speed_qwen3_vl_tower
    from qvl.kernels.tower_graphs import MegatronTowerGraphs, _MegatronBucketGraph

    graphs = MegatronTowerGraphs(tower, cuda=False)
    pixels, inputs, _ = _megatron_call(tower, MEGATRON_CALLS[1], seed=0)
    graph = _MegatronBucketGraph(graphs, TowerBucket(patches=208, blocks=16, windows=0, longest=208), pixels)
    graph.fill(pixels, inputs)
    assert graph.cu_seqlens.tolist() == inputs.cu_seqlens.tolist() + [208] * (17 - inputs.cu_seqlens.shape[0])
    assert torch.equal(graph.pixels[:196], pixels) and not graph.pixels[196:].any()
    assert not graph.pos_embed_index[:, 196:].any() and not graph.pos_embed_weight[:, 196:].any()
    # per patch, the upstream embedding (looked up per grid position, repeated over frames and permuted)
    table = tower.pos_embed.weight
    corners = tower.pos_embed(graph.pos_embed_index[:, :196]) * graph.pos_embed_weight[:, :196, None]
    per_patch = corners[0] + corners[1] + corners[2] + corners[3]
    assert torch.equal(per_patch, speed_qwen3_vl_tower.interpolated_pos_embed(tower, inputs).to(table.dtype))


def test_qwen3_vl_calls_the_graphs_cannot_take_run_eagerly(tower):
    from qvl.kernels.tower_graphs import MegatronTowerGraphs

    graphs = MegatronTowerGraphs(tower, cuda=False)
    pixels, inputs, _ = _megatron_call(tower, MEGATRON_CALLS[3], seed=0)
    assert graphs.eager_reason(inputs) is None
    assert graphs.eager_reason(tower_inputs_for_config(MEGATRON_CALLS[3], tiny_tower("qwen2_5_vl").config)) == (
        "a call without the loader's tower inputs"
    )
    with torch.no_grad():
        assert graphs.eager_reason(inputs) == "a call without autograd (evaluation)"
    assert graphs.bucket_graph(pixels, inputs) == (None, "trained tower parameters without Megatron DDP's main_grad")
    embeds, deepstack = graphs(pixels, None, MEGATRON_CALLS[3])  # eagerly, upstream's forward
    want, want_deepstack = tower(hidden_states=pixels, grid_thw=MEGATRON_CALLS[3])
    assert torch.equal(embeds, want) and all(map(torch.equal, deepstack, want_deepstack))
    assert graphs.stats()["eager_because"] == ["a call without the loader's tower inputs"]


def test_a_graphed_qwen3_vl_call_launches_what_the_census_counts_for_it(tower):
    from qvl.kernels.tower_graphs import MegatronTowerGraphs, _MegatronBucketGraph

    graphs = MegatronTowerGraphs(tower, cuda=False)
    pixels, inputs, _ = _megatron_call(tower, MEGATRON_CALLS[1], seed=0)
    graph = _MegatronBucketGraph(graphs, TowerBucket(patches=208, blocks=16, windows=0, longest=208), pixels)
    outputs = 1 + len(tower.config.deepstack_visual_indexes)
    graph.grad_outputs = tuple(torch.zeros(52, 8) for _ in range(outputs))
    with _Launches() as fills:
        graph.fill(pixels, inputs)
    graph.replay = types.SimpleNamespace(backward=lambda: None)
    grads = [torch.ones(49, 8)] * outputs
    with _Launches() as gradient:
        tower_graphs._Replayed.backward(types.SimpleNamespace(graph=graph, rows=49), *grads)
    assert len(fills.ops) == tower_graphs.MEGATRON_FILL_LAUNCHES, fills.ops
    assert len(gradient.ops) == tower_graphs.GRADIENT_LAUNCHES * outputs, gradient.ops
    assert tower_graphs.launches_per_call(windowed=False, outputs=outputs, megatron=True) == (
        len(fills.ops) + len(gradient.ops) + 2
    )
