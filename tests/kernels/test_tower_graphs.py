"""The replicated HF vision tower replayed as CUDA graphs at bucketed shapes (qvl.kernels.tower_graphs). On the CPU the
same buffers, padding and gradient routing run through `EagerReplay`: every call of a bucket (the eager first one, the
captured second, replays, and the eager fallback while a backward is pending) gives the tower's own output rows, and
the gradients reach `main_grad` as Megatron-Core's DDP would put them there. The graphs' own tests run on a GPU
(`gpu`) and, with the graphs recorded and replayed as captured (qvl.foundation.graph_replay), on the CPU."""

from __future__ import annotations

import copy
import json
import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation import patches
from qvl.foundation.graph_replay import recorded_graphs
from qvl.kernels import speed_hf_vision, tower_graphs
from qvl.kernels.speed_hf_vision import tower_kwargs
from qvl.kernels.torch_wgrad_accum import MainGradLinear
from qvl.kernels.tower_buckets import TowerBucket, tower_bucket
from qvl.kernels.tower_graphs import TowerGraphs
from qvl.kernels.tower_inputs import tower_inputs_for_config
from qvl.kernels.varlen_attention import HF_VARLEN_ATTENTION, register_hf_varlen_attention
from tests.kernels.test_speed_hf_vision import HF_TOWER_FAMILIES, tiny_tower

# Calls of one bucket (176 and 168 rows: a bucket of 176), then one of another (32 rows).
CALLS = (
    torch.tensor([[1, 8, 12], [1, 4, 4], [2, 4, 8]]),
    torch.tensor([[1, 8, 12], [1, 4, 4], [1, 4, 14]]),
    torch.tensor([[1, 8, 12], [1, 4, 4], [2, 4, 8]]),
    torch.tensor([[1, 4, 8]]),
)


def _ddp_like(tower: torch.nn.Module) -> None:
    """What qvl's build and Megatron-Core's DDP give the tower: `MainGradLinear`s, a `main_grad` per parameter, and a
    hook adding `.grad` into it unless the gradient is already there (`_make_backward_post_hook`)."""
    for module in tower.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = MainGradLinear
    _main_grads(tower)


def _main_grads(tower: torch.nn.Module) -> list:
    """A zero `main_grad` per parameter and DDP's hook adding `.grad` into it; the hooks' handles."""
    handles = []
    for param in tower.parameters():
        param.main_grad = torch.zeros_like(param)
        param.grad_added_to_main_grad = False

        def hook(p: torch.nn.Parameter) -> None:
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None

        handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


def _call(tower, grid: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    config = tower.config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
    inputs = tower_inputs_for_config(grid, config)
    rows = pixels.shape[0] // config.spatial_merge_size**2
    out_width = getattr(config, "out_hidden_size", None) or config.hidden_size  # Qwen2.5-VL's, Qwen2-VL's
    weights = torch.randn(rows, out_width, generator=generator)
    return pixels, inputs, weights


def _reference_call(reference, pixels, inputs, grid, weights, expected: dict) -> tuple[torch.Tensor, tuple]:
    """The eager tower's output rows for a call and its parameters' gradients of `(output * weights).sum()`, which
    are added into `expected` (by name)."""
    want = reference(pixels, grid_thw=grid, **tower_kwargs(inputs)).pooler_output
    grads = torch.autograd.grad((want * weights).sum(), list(reference.parameters()))
    for (name, _), grad in zip(reference.named_parameters(), grads, strict=True):
        expected[name] += grad
    return want, grads


def _graphed_copy(family: str, **graph_options) -> tuple[torch.nn.Module, torch.nn.Module, TowerGraphs]:
    """(reference, tower, graphs): a tiny eager tower, and a copy of it with DDP-like `main_grad`s and its graphs
    (the CPU's `EagerReplay`)."""
    reference = tiny_tower(family, attention=HF_VARLEN_ATTENTION)
    tower = copy.deepcopy(reference)
    _ddp_like(tower)
    return reference, tower, TowerGraphs(tower, cuda=False, **graph_options)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_every_call_of_a_bucket_gives_the_towers_rows_and_gradients(family):
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        reference, tower, graphs = _graphed_copy(family)
        expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
        for index, grid in enumerate(CALLS):
            pixels, inputs, weights = _call(tower, grid, seed=index)
            want, grads = _reference_call(reference, pixels, inputs, grid, weights, expected)
            got = graphs(pixels, inputs, grid)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"call {index + 1}")
            if index == 2:  # a second call of the bucket before the backward: it runs eagerly, then both go back
                again = graphs(pixels, inputs, grid)
                torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)
                for (name, _), grad in zip(reference.named_parameters(), grads, strict=True):
                    expected[name] += grad
                got = got + again
            (got * weights).sum().backward()
        buckets = list(graphs.buckets.values())
        assert [b.bucket.patches for b in buckets] == [176, 32]
        assert buckets[0].calls == 3 and buckets[0].replay is not None and not buckets[0].pending  # captured, replayed
        assert buckets[1].calls == 1 and buckets[1].replay is None  # eager so far
        assert graphs.refused == {"a second call while the bucket's backward is pending"}
        assert graphs.stats() == {
            "buckets": 2,
            "planned_sizes": 0,
            "regrown": 0,
            "calls": {"warm-up": 2, "captured": 1, "replayed": 1, "eager": 1},
            "padding_share": round(560 / 552 - 1, 4),
            "eager_because": ["a second call while the bucket's backward is pending"],
        }
        for name, param in tower.named_parameters():
            assert param.grad is None
            scale = float(expected[name].abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_images_and_videos_together_are_the_inputs_of_their_grids_one_after_the_other(family):
    """`tower_inputs.together` (a micro-batch's images and videos in one graphed call) gives exactly what transformers
    computes for the two grids concatenated, and the tower's rows for it are the two calls' rows."""
    from qvl.kernels.tower_inputs import together

    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        tower = tiny_tower(family, attention=HF_VARLEN_ATTENTION)
        images, videos = CALLS[0], torch.tensor([[4, 4, 8], [2, 8, 4]])
        calls = [_call(tower, grid, seed=index) for index, grid in enumerate((images, videos))]
        rows = calls[0][0].shape[0]
        merge_unit = tower.config.spatial_merge_size**2
        got = together(calls[0][1], calls[1][1], rows=rows, merge_unit=merge_unit)
        want = tower_inputs_for_config(torch.cat([images, videos]), tower.config)
        for name in ("position_ids", "cu_seqlens", "max_seqlen", "window_index", "cu_window_seqlens",
                     "max_window_seqlen"):  # fmt: skip
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(torch.as_tensor(a), torch.as_tensor(b)), name
        with torch.no_grad():
            apart = [
                tower(p, grid_thw=g, **tower_kwargs(i)).pooler_output for (p, i, _), g in zip(calls, (images, videos))
            ]
            pixels = torch.cat([calls[0][0], calls[1][0]])
            joined = tower(pixels, grid_thw=torch.cat([images, videos]), **tower_kwargs(got)).pooler_output
        torch.testing.assert_close(joined, torch.cat(apart), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_a_size_waits_eagerly_while_another_sizes_replayed_backward_is_pending(family):
    """Micro-batches of two tower calls (a Qwen2.5-VL pack's images, then its videos) of two sizes, the backward after
    both: the graphs share one memory pool, so while one size's replayed backward is pending the other neither
    captures nor replays (it runs eagerly); its first call, eager outside the pool, may run. Every call gives the
    tower's rows and the gradients reach `main_grad`."""
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        reference, tower, graphs = _graphed_copy(family)
        large, small = CALLS[0], CALLS[3]  # buckets of 176 and 32 rows
        micro_batches = ((large, small), (large, small), (large, small), (small, large))
        kinds = []
        expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
        for step, calls in enumerate(micro_batches):
            loss = 0.0
            for index, grid in enumerate(calls):
                pixels, inputs, weights = _call(tower, grid, seed=2 * step + index)
                want, _ = _reference_call(reference, pixels, inputs, grid, weights, expected)
                before = dict(graphs.calls)
                got = graphs(pixels, inputs, grid)
                kinds.append(next(k for k, n in graphs.calls.items() if n != before.get(k, 0)))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"micro-batch {step + 1}")
                loss = loss + (got * weights).sum()
            loss.backward()
        assert kinds == [
            "warm-up", "warm-up",  # neither uses the pool
            "captured", "eager",  # the large size's replayed backward is pending: the small one waits
            "replayed", "eager",
            "captured", "eager",  # the other way round
        ]  # fmt: skip
        reason = "a call while another size's replayed backward is pending (one memory pool)"
        assert graphs.stats()["eager_because"] == [reason]
        assert not any(bucket.pending for bucket in graphs.buckets.values())
        for name, param in tower.named_parameters():
            scale = float(expected[name].abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_a_size_whose_slots_are_short_is_graphed_again_with_more(family):
    """Two sizes planned from the dataset's calls (32 and 176 rows: 64 and 168 rows go into 176), one graph per size:
    a call of 64 rows in 16 frames needs more blocks than the size's first call left slots for, so the size's graph
    is made again with twice the slots (an eager warm-up, then captured); every call gives the tower's rows and the
    gradients reach `main_grad`."""
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        reference, tower, graphs = _graphed_copy(family, max_graphs=2, planned_calls=[176, 168, 32, 0])
        assert graphs.sizes == (32, 176) and graphs.bucket_rows(64) == graphs.bucket_rows(168) == 176
        frames = torch.tensor([[16, 2, 2]])  # 64 rows, 16 blocks: 17 with the pad block
        calls = (torch.tensor([[1, 8, 8]]), frames, frames, frames, CALLS[1], CALLS[3])
        expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
        for index, grid in enumerate(calls):
            pixels, inputs, weights = _call(tower, grid, seed=index)
            want, _ = _reference_call(reference, pixels, inputs, grid, weights, expected)
            got = graphs(pixels, inputs, grid)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"call {index + 1}")
            (got * weights).sum().backward()
        assert graphs.buckets[176].bucket.blocks == 32 and graphs.buckets[176].calls == 4
        assert graphs.stats() == {
            "buckets": 2,
            "planned_sizes": 2,
            "regrown": 1,
            "calls": {"warm-up": 3, "captured": 1, "replayed": 2},
            "padding_share": round((176 * 5 + 32) / (64 * 4 + 168 + 32) - 1, 4),
            "eager_because": [],
        }
        for name, param in tower.named_parameters():
            scale = float(expected[name].abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_the_pad_rows_are_blocks_and_windows_of_their_own():
    """168 rows in the bucket of 176: one pad block over rows 168-176 then empty blocks (in a bucket of 368 whose
    longest block is 96 rows, three); the pad rows in windows of at most the tower's window (16 rows) then empty
    windows; the pad merge units after the call's, in place."""
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        tower = tiny_tower("qwen2_5_vl", attention=HF_VARLEN_ATTENTION)
        graphs = TowerGraphs(tower, cuda=False)
        pixels, inputs, _ = _call(tower, CALLS[1], seed=0)
        windows = inputs.cu_window_seqlens.shape[0] - 1
        bucket = tower_bucket(168, 3, windows, unit=16, window=16, longest=inputs.max_seqlen)
        graph = tower_graphs._BucketGraph(graphs, bucket, pixels)
        graph.fill(pixels, inputs)
    assert graph.cu_seqlens.tolist() == inputs.cu_seqlens.tolist() + [176] * 13
    windows = inputs.cu_window_seqlens.tolist()
    assert graph.cu_window_seqlens.tolist() == windows + [176] * (128 - len(windows) + 1)
    assert graph.window_index.tolist() == inputs.window_index.tolist() + [42, 43]
    assert torch.equal(graph.pixels[:168], pixels) and not graph.pixels[168:].any()
    assert not graph.position_ids[168:].any()
    wider = tower_graphs._BucketGraph(graphs, TowerBucket(patches=208, blocks=16, windows=128, longest=96), pixels)
    wider.fill(pixels, inputs)  # 40 pad rows: windows of 16, 16 and 8 rows
    assert wider.cu_window_seqlens.tolist() == windows + [184, 200] + [208] * (129 - len(windows) - 2)
    split = tower_graphs._BucketGraph(graphs, TowerBucket(patches=368, blocks=16, windows=128, longest=96), pixels)
    split.fill(pixels, inputs)  # 200 pad rows in blocks of at most the bucket's longest (96 rows), then empty ones
    assert split.cu_seqlens.tolist() == inputs.cu_seqlens.tolist() + [264, 360] + [368] * 11


def test_the_tower_is_graphed_where_speed_cuda_graphs_marked_it(monkeypatch):
    """With the language model's layers graphed or without them (MoE and Gated DeltaNet layers, full recompute: the
    tower alone), not where the group left it eager (DDP overlapping its reduction), and not on a machine without
    CUDA running a CUDA run's groups (the census)."""
    config = types.SimpleNamespace(cuda_graph_impl="none", qvl_tower_graphs=False)
    model = types.SimpleNamespace(visual=tiny_tower("qwen2_vl"), config=config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    assert tower_graphs.tower_graphs(model) is None  # an eager run
    config.cuda_graph_impl = "local"
    assert tower_graphs.tower_graphs(model) is None  # graphed layers, DDP overlapping its reduction
    for impl in ("local", "none"):  # with the layers' graphs, and alone
        config.cuda_graph_impl, config.qvl_tower_graphs = impl, True
        assert isinstance(tower_graphs.tower_graphs(model), TowerGraphs), impl
        del model.visual.qvl_graphs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tower_graphs.tower_graphs(model) is None


def test_a_run_plans_its_towers_bucket_sizes_from_its_dataset(monkeypatch, tmp_path):
    packs = [{"lengths": [9], "vision_rows": [rows, 0]} for rows in (168, 176, 32, 168)]
    (tmp_path / "packs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in packs))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    tower = tiny_tower("qwen2_vl")
    config = types.SimpleNamespace(cuda_graph_impl="local", qvl_tower_graphs=True, qvl_tower_dataset=str(tmp_path))
    graphs = tower_graphs.tower_graphs(types.SimpleNamespace(visual=tower, config=config))
    assert graphs.sizes == (32, 168, 176) and graphs.bucket_rows(100) == 168
    config.qvl_tower_dataset = None  # no plan: the geometric grid
    del tower.qvl_graphs
    assert tower_graphs.tower_graphs(types.SimpleNamespace(visual=tower, config=config)).sizes == ()


def test_calls_the_graphs_cannot_take_run_eagerly():
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        tower = tiny_tower("qwen2_5_vl", attention=HF_VARLEN_ATTENTION)
        graphs = TowerGraphs(tower, cuda=False)
        pixels, inputs, _ = _call(tower, CALLS[0], seed=0)
        assert graphs.bucket_graph(pixels, inputs) == (
            None,
            "trained tower parameters without Megatron DDP's main_grad",
        )
        _ddp_like(tower)
        assert graphs.eager_reason(inputs) is None
        assert graphs.eager_reason(None) == "a call without the loader's tower inputs"
        with torch.no_grad():
            assert graphs.eager_reason(inputs) == "a call without autograd (evaluation)"
        want = tower(pixels, grid_thw=CALLS[0], **tower_kwargs(inputs)).pooler_output
        graphs(pixels, inputs, CALLS[0]).sum().backward()  # the bucket's first call: eager

        class Uncapturable(tower_graphs.EagerReplay):
            def capture(self, forward, backward):
                raise RuntimeError("operation not permitted when stream is capturing\nmore")

        graphs.new_replay = Uncapturable
        for _ in range(2):  # the capture fails: this call and the bucket's later ones run eagerly
            got = graphs(pixels, inputs, CALLS[0])
            torch.testing.assert_close(got, want)
            got.sum().backward()
        reason = "a bucket whose capture failed (RuntimeError: operation not permitted when stream is capturing)"
        assert graphs.stats()["calls"] == {"warm-up": 1, "eager": 2} and graphs.stats()["eager_because"] == [reason]
        inputs.max_window_seqlen = 17
        assert graphs.eager_reason(inputs) == "a window of 17 rows (the graphs' longest is 16)"


def _graphed_against_eager(family: str, micro_batches: list[tuple[torch.Tensor, ...]], calls: dict) -> None:
    """bf16 with qvl's varlen attention (as training runs the tower), on CUDA or on the CPU with recorded graphs
    (qvl.foundation.graph_replay): the tower calls of `micro_batches` (each micro-batch's calls, then its backward)
    through captured graphs and through the same passes re-run eagerly give the same rows and `main_grad`s; both
    count `calls` by kind."""
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        base = tiny_tower(family, dtype=torch.bfloat16, attention=HF_VARLEN_ATTENTION).cuda()
        results = []
        for cuda in (False, True):
            tower = copy.deepcopy(base)
            _ddp_like(tower)
            graphs = TowerGraphs(tower, cuda=cuda)
            outputs = []
            for grids in micro_batches:
                loss = 0.0
                for grid in grids:
                    pixels, inputs, weights = _call(tower, grid, seed=len(outputs))
                    got = graphs(pixels.cuda().bfloat16(), inputs.to("cuda"), grid.cuda())
                    loss = loss + (got.float() * weights.cuda().float()).sum()
                    outputs.append(got.float())
                loss.backward()
            torch.cuda.synchronize()
            assert graphs.stats()["calls"] == calls, graphs.stats()
            results.append((outputs, {n: p.main_grad.float() for n, p in tower.named_parameters()}))
        (eager_out, eager_grads), (graph_out, graph_grads) = results
        for index, (got, want) in enumerate(zip(graph_out, eager_out, strict=True)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=f"call {index + 1}")
        for name, want in eager_grads.items():
            scale = float(want.abs().max()) + 1e-6
            torch.testing.assert_close(graph_grads[name], want, rtol=2e-2, atol=2e-2 * scale, msg=name)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_recorded_graphs_replay_what_the_eager_replay_computes(family, cpu_runtime):
    """The GPU tests below with the graphs recorded on the CPU: replayed as captured, Python not run again."""
    with recorded_graphs():
        _graphed_against_eager(family, [(grid,) for grid in CALLS[:3]], {"warm-up": 1, "captured": 1, "replayed": 1})
        micro_batches = [(CALLS[0], CALLS[3])] * 3 + [(CALLS[3], CALLS[0])]
        _graphed_against_eager(family, micro_batches, {"warm-up": 2, "captured": 2, "replayed": 1, "eager": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_the_cuda_graphs_replay_what_the_eager_replay_computes(family):
    """Calls of two sizes in one bucket, a backward after each: the eager first, then captured, then replayed."""
    micro_batches = [(grid,) for grid in CALLS[:3]]
    _graphed_against_eager(family, micro_batches, {"warm-up": 1, "captured": 1, "replayed": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_two_sizes_in_one_pool_keep_their_gradients_on_cuda(family):
    """Micro-batches of two tower calls of two sizes, the backward after both (the order that would let one size's
    replay overwrite the other's saved activations in the shared pool): the second call of each waits, eagerly."""
    micro_batches = [(CALLS[0], CALLS[3])] * 3 + [(CALLS[3], CALLS[0])]
    _graphed_against_eager(family, micro_batches, {"warm-up": 2, "captured": 2, "replayed": 1, "eager": 3})


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_a_pack_trains_with_its_tower_graphed_as_it_does_eagerly(family, tmp_path, cpu_runtime, monkeypatch):
    """qvl's Qwen2-VL / Qwen2.5-VL forward hands a micro-batch's images and videos to the tower's graphs as one call
    (`tower_inputs.together`): over three micro-batches (warm-up, capture, replay) the losses are the eager ones (two
    calls each) and the tower's `main_grad`s sum the eager gradients (fp32)."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation import distributed
    from qvl.kernels import speed_rotary, speed_sync_free
    from qvl.training.step import host_batch, model_inputs
    from tests.kernels.test_speed_sync_free import _batch, _loss_and_grads
    from tests.tiny_megatron import tiny_megatron_model

    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model(family, hf=hf, speed=False)
        batch = _batch(family, hf_config, math.prod(model.visual.patch_embed.proj.weight.shape[1:]))
        for kind in ("image", "video"):  # what the loader's workers compute
            grid = getattr(batch, f"{kind}_grid_thw")
            setattr(batch, f"{kind}_tower_inputs", tower_inputs_for_config(grid, model.visual.config))
        cpu = torch.device("cpu")
        kwargs, _ = model_inputs(batch, cpu)
        kwargs["host_batch"] = host_batch(model, batch, kwargs, cpu)
        with patches.applied(speed_rotary.GROUP, speed_sync_free.GROUP):
            eager_losses, eager_grads = _loss_and_grads(model, kwargs)
            _ddp_like(model.visual)
            graphs = TowerGraphs(model.visual, cuda=False)
            monkeypatch.setattr(speed_sync_free, "tower_graphs", lambda m: graphs)
            for _ in range(3):
                losses, _ = _loss_and_grads(model, kwargs)
                torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
        assert graphs.stats()["calls"] == {"warm-up": 1, "captured": 1, "replayed": 1}  # one call per micro-batch
        assert len(graphs.buckets) == 1
        for name, param in model.visual.named_parameters():
            want = 3 * eager_grads[f"visual.{name}"]
            scale = float(want.abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    finally:
        distributed.destroy_distributed()


class _Launches(TorchDispatchMode):
    """Counts the aten ops that run a kernel (views and allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_a_graphed_call_launches_what_the_census_counts_for_it(family):
    """The census charges a graphed tower call `launches_per_call` kernels: its fills, two replays, the gradient."""
    register_hf_varlen_attention()
    with patches.applied(speed_hf_vision.GROUP):
        tower = tiny_tower(family, attention=HF_VARLEN_ATTENTION)
        graphs = TowerGraphs(tower, cuda=False)
        pixels, inputs, _ = _call(tower, CALLS[1], seed=0)
        windows = None if graphs.window is None else inputs.cu_window_seqlens.shape[0] - 1
        unit = graphs.merge_unit if graphs.window is None else graphs.window
        blocks = inputs.cu_seqlens.shape[0] - 1
        bucket = tower_bucket(168, blocks, windows, unit=unit, window=graphs.window, longest=inputs.max_seqlen)
        graph = tower_graphs._BucketGraph(graphs, bucket, pixels)
        graph.grad_outputs = (torch.zeros(bucket.patches // 4, 8),)
        with _Launches() as fills:
            graph.fill(pixels, inputs)
        graph.replay = types.SimpleNamespace(backward=lambda: None)
        grad = torch.ones(42, 8)
        with _Launches() as gradient:
            tower_graphs._Replayed.backward(types.SimpleNamespace(graph=graph, rows=42), grad)
    windowed = family == "qwen2_5_vl"
    assert len(fills.ops) == tower_graphs.FILL_LAUNCHES[windowed], fills.ops
    assert len(gradient.ops) == tower_graphs.GRADIENT_LAUNCHES, gradient.ops
    assert tower_graphs.launches_per_call(windowed=windowed) == len(fills.ops) + len(gradient.ops) + 2
