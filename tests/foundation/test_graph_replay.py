"""CUDA graphs recorded and replayed on the CPU (qvl.foundation.graph_replay, patch group "cpu-cuda-graphs"): a replay
runs the captured ops again on the capture's tensors, new inputs reach it only through the buffers it read, Python
does not run at a replay, and a capture refuses host reads of device tensors as a device's capture does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qvl.foundation import graph_replay, patches
from qvl.foundation.graph_replay import GraphCaptureError, RecordedGraph, recorded_graphs


def _captured_step(linear: torch.nn.Linear, main_grad: torch.Tensor, scale: list[float]):
    """A forward and a backward graph over static buffers, the weight's gradient added into `main_grad` inside the
    backward graph (as Megatron-Core's graphs do); `scale` is read by Python at capture only."""
    static_x = torch.zeros(5, 4, requires_grad=True)
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(forward, pool=pool):
        y = F.gelu(linear(static_x)).sum(-1) * scale[0]
    static_grad = torch.zeros_like(y)
    with torch.cuda.graph(backward, pool=pool):
        grad_x, grad_w = torch.autograd.grad(y, (static_x, linear.weight), static_grad)
        main_grad.add_(grad_w)
    return static_x, static_grad, forward, backward, y, grad_x


def test_a_replay_runs_the_captured_ops_on_the_inputs_copied_into_its_buffers(cpu_runtime):
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    main_grad = torch.zeros_like(linear.weight)
    scale = [2.0]
    with recorded_graphs():
        static_x, static_grad, forward, backward, y, grad_x = _captured_step(linear, main_grad, scale)
        assert graph_replay.is_capturing() is False and type(forward) is RecordedGraph
        main_grad.zero_()  # the capture ran the ops once, as a device's warm-up would have
        scale[0] = 3.0  # Python is not run again: the replays keep the captured 2.0
        want = torch.zeros_like(main_grad)
        for step in range(3):
            x, grad = torch.randn(5, 4), torch.randn(5)
            static_x.detach().copy_(x)
            static_grad.copy_(grad)
            forward.replay()
            backward.replay()
            eager_x = x.clone().requires_grad_()
            eager_y = F.gelu(linear(eager_x)).sum(-1) * 2.0
            eager_grad_x, eager_grad_w = torch.autograd.grad(eager_y, (eager_x, linear.weight), grad)
            want += eager_grad_w
            torch.testing.assert_close(y, eager_y, rtol=0, atol=0, msg=f"replay {step}")
            torch.testing.assert_close(grad_x, eager_grad_x, rtol=0, atol=0)
            torch.testing.assert_close(main_grad, want, rtol=1e-6, atol=1e-7)  # added in place at every replay
        assert forward.replays == backward.replays == 3


def test_a_replay_leaves_version_counters_as_a_device_does(cpu_runtime):
    with recorded_graphs():
        static = torch.zeros(3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = static * 2
        leaf = torch.ones(3, requires_grad=True)
        product = leaf * out  # saves `out` for its backward
        static.copy_(torch.arange(3.0))
        graph.replay()
        product.sum().backward()  # no "modified by an inplace operation" error
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 4.0]))
    torch.testing.assert_close(leaf.grad, out)


@pytest.mark.parametrize(
    ("read", "named"),
    [
        (lambda t: t.sum().item(), "Tensor.item()"),
        (lambda t: t.tolist(), "Tensor.tolist()"),
        (lambda t: bool(t[0] > 0), "Tensor.__bool__()"),
        (lambda t: torch.ops.aten._local_scalar_dense(t[0]), "aten._local_scalar_dense"),
        (lambda t: torch.nonzero(t), "aten.nonzero"),
        (lambda t: t[t > 0], "aten.index"),
    ],
)
def test_a_capture_refuses_to_read_a_device_tensor_on_the_host(cpu_runtime, read, named):
    device = torch.arange(4.0)
    with recorded_graphs():
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(GraphCaptureError, match="operation not permitted when stream is capturing") as error:
            with torch.cuda.graph(graph):
                read(device * 1)
        assert named in str(error.value) and isinstance(error.value, RuntimeError)
        assert not graph_replay.is_capturing()  # the failed capture ended
        with torch.cuda.graph(torch.cuda.CUDAGraph()):  # outside a failed one, the next capture works
            device + 1


def test_a_capture_reads_host_tensors_as_megatrons_rng_fork_does(cpu_runtime):
    """Megatron-Core's RNG tracker compares the CPU generator's state inside its forks (`.item()` of host tensors)."""
    with recorded_graphs():
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            state = torch.get_rng_state()
            assert torch.all(state == torch.get_rng_state()).item()
            assert torch.tensor([1, 2]).tolist() == [1, 2]


def test_the_stand_ins_are_in_place_only_while_applied(cpu_runtime):
    original = torch.cuda.CUDAGraph
    with recorded_graphs():
        assert torch.cuda.CUDAGraph is RecordedGraph and graph_replay.can_capture()
        assert patches.is_applied(graph_replay.GROUP)
    assert torch.cuda.CUDAGraph is original and not graph_replay.can_capture()
    assert graph_replay.is_capturing() is False  # without a device and without the group: no capture, no CUDA call


def test_the_cpu_generator_forks_graph_safely(cpu_runtime):
    """With graphs asked for, Megatron-Core's tracker keeps generators: forks draw the tracker's numbers and restore
    the default generator's."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with recorded_graphs():
        tracker = CudaRNGStatesTracker(use_cudagraphable_rng=True)
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(7)
        before = torch.get_rng_state()
        with tracker.fork():
            first = torch.rand(3)
        torch.testing.assert_close(torch.get_rng_state(), before)  # the default generator as it was
        with tracker.fork():
            second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracker's state moved on between forks
    torch.manual_seed(123)
    torch.testing.assert_close(first, torch.rand(3))  # the tracker's stream is its seed's


def replayed_collectives() -> dict:
    """On a rank of a two-rank job: an all-gather, a reduce-scatter (gloo finishes it when its work is waited for)
    and an async all-reduce captured, then replayed on new inputs; what the replay wrote and what eager gives."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with recorded_graphs():
        x = torch.zeros(4)
        gathered, scattered, reduced = torch.zeros(8), torch.zeros(2), torch.zeros(4)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_gather_into_tensor(gathered, x * 1)
            dist.reduce_scatter_tensor(scattered, x * 2)
            handle = dist.all_reduce(torch.add(x, 0, out=reduced), async_op=True)
            handle.wait()
        x.copy_(torch.arange(4.0) + 10 * rank)
        graph.replay()
        replayed = [t.clone() for t in (gathered, scattered, reduced)]
    eager = [torch.zeros(8), torch.zeros(2), x.clone()]
    dist.all_gather_into_tensor(eager[0], x)
    dist.reduce_scatter_tensor(eager[1], x * 2)
    dist.all_reduce(eager[2])
    return {"replayed": replayed, "eager": eager}


def test_collectives_are_recorded_whole_and_replay_on_new_inputs():
    from qvl.foundation.distributed import run_on_ranks

    for rank in run_on_ranks(replayed_collectives, world_size=2, cpu=True):
        for got, want in zip(rank["replayed"], rank["eager"], strict=True):
            assert torch.equal(got, want)
