"""CUDA graphs on the CPU: a capture records the aten ops it runs, a replay runs those ops again on the same tensors
(patch group "cpu-cuda-graphs" of qvl.foundation.patches; `recorded_graphs()`, for tests and smoke runs).

A CUDA graph replays the kernels its capture launched, on the memory they used then: no Python runs at a replay, a
value the capture read on the host stays what it was, and an input reaches the graph only by being copied into the
tensor the capture read. Code that drives graphs (Megatron-Core's per-layer `CudaGraphManager`, qvl's vision tower
graphs, qvl.kernels.tower_graphs) is right only if it keeps those rules; none of it can run where there is no GPU,
because `torch.cuda.CUDAGraph` needs one. Here `RecordedGraph` stands in for it: `capture_begin` starts recording
every aten op dispatched on this thread (a `TorchDispatchMode`, below autograd: the ops a device would launch,
backward ones included), `capture_end` stops, and `replay` runs the recorded ops again in their order, with the
same arguments: the same tensor objects. An op's result that is a new tensor (not a view or an in-place write of an
argument) is copied into the tensor the capture made, so that later ops, which hold that tensor, read the new
values, as a replayed kernel writes the capture's memory. Version counters are left as a replay leaves them on a
device: unchanged. The capture also runs the ops once (a CUDA capture does not, but its warm-up does), so code that
captures sees the values it would see after a replay. A collective (`torch.distributed`'s functions, seen as torch
functions) is recorded whole, waited for, as a device's graph holds a NCCL kernel: gloo finishes some of them in
ops of its own when their work is waited for, which must not replay on the capture's buffers. A backward that
`torch.autograd.grad` runs inside a capture is captured too (the recording stays on for it, qvl.foundation.runtime's
`grad_with_mode_on`).

A capture refuses what a device's capture refuses, with its error ("operation not permitted when stream is
capturing"): a read of a device tensor on the host (`.item()`, `.tolist()`, `bool()`, ... and ops whose output size
depends on values, `nonzero` and the like), which would otherwise stay baked into the replays. Which tensors are on
the host follows their making: every tensor the capture did not make is on the device except generator states
(uint8: Megatron-Core's RNG tracker compares the CPU generator's state inside its forks), and an op's results are
on the host only where all its tensor inputs are (a factory's too: a device factory inside a capture is not seen).

What the stand-in does not model: the graph memory pool (every tensor a capture made stays alive with its graph,
where a pool could reuse a freed one: an overlap bug between graphs shows on a GPU only), streams and events, and
work on host tensors, which a CUDA graph does not replay and this one does. Random ops draw new numbers at every
replay, as a graph-safe generator gives them on a device.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from qvl.foundation import patches

GROUP = "cpu-cuda-graphs"
_POOLS = itertools.count(1)
# Tensor methods that read a device value on the host (the step census counts them too).
HOST_READ_METHODS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})
# Ops whose output size depends on tensor values: the host waits for the device to know it.
VALUE_SIZED_OPS = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                             "unique_dim", "bincount", "histc"})  # fmt: skip
CAPTURE_ERROR = "operation not permitted when stream is capturing"
_FROM_PYTHON = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})  # `torch.tensor(data)`: a host tensor


class GraphCaptureError(RuntimeError):
    """What a device's capture raises for a host read."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RecordedOp:
    """One aten op of a capture: what ran, on what, and the outputs a replay writes into (the new tensors)."""

    func: Any
    args: tuple
    kwargs: dict
    written: tuple[tuple[int, torch.Tensor], ...]  # (position in the flattened result, the capture's tensor)

    def run(self) -> None:
        outputs = _completed(self.func(*self.args, **self.kwargs))
        for index, captured in self.written:
            captured.copy_(outputs[index])


def _completed(result: Any) -> list:
    """`result`'s leaves, a collective's work waited for: gloo finishes some collectives in a callback of their work
    (a reduce-scatter's split and copies), which must run as part of the op, not be recorded as ops of their own."""
    outputs = pytree.tree_leaves(result)
    for output in outputs:
        if not isinstance(output, torch.Tensor) and callable(getattr(output, "wait", None)):
            output.wait()
    return outputs


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}


def _written_outputs(args: tuple, kwargs: dict, result: Any) -> tuple[tuple[int, torch.Tensor], ...]:
    """The result's tensors that are new memory, with their places: not views of an argument, not written in place."""
    given = _storages((args, kwargs))
    return tuple(
        (i, t)
        for i, t in enumerate(pytree.tree_leaves(result))
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in given
    )


class _Placement:
    """Which tensors of a capture are on the host (see the module docstring)."""

    def __init__(self) -> None:
        self.host = WeakIdKeyDictionary()
        self.made = WeakIdKeyDictionary()

    def on_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self.host or (tensor not in self.made and tensor.dtype == torch.uint8)

    def refuse_read(self, what: str, tensors: list[torch.Tensor]) -> None:
        device = [t for t in tensors if not self.on_host(t)]
        if device:
            shape = tuple(device[0].shape)
            raise GraphCaptureError(
                f"{CAPTURE_ERROR}: {what} reads a device tensor ({device[0].dtype}, shape {shape}) on the host "
                "inside a CUDA graph capture; give the value as a Python number from outside the graph, or keep it "
                "on the device"
            )

    def place(self, name: str, inputs: list[torch.Tensor], result: Any) -> None:
        host = name in _FROM_PYTHON or all(self.on_host(t) for t in inputs)
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.made[t] = True
                if host:
                    self.host[t] = True
                else:
                    self.host.pop(t, None)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _bool_index(name: str, args: tuple) -> bool:
    return name in ("index", "index_put", "index_put_") and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in pytree.tree_leaves(args[1:2])
    )


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph, placement: _Placement) -> None:
        super().__init__()
        self.graph, self.placement = graph, placement
        self.inside_collective = 0  # a collective recorded whole: the ops it runs are its own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_collective:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        if name == "_local_scalar_dense" or name in VALUE_SIZED_OPS or _bool_index(name, args):
            self.placement.refuse_read(f"aten.{name}", inputs)
        result = func(*args, **kwargs)
        self.placement.place(name, inputs, result)
        self.graph.ops.append(
            RecordedOp(func=func, args=args, kwargs=kwargs, written=_written_outputs(args, kwargs, result))
        )
        return result


class _FunctionLevel(TorchFunctionMode):
    """What a capture sees above the ops: host reads that dispatch no op (`.tolist()`, `.numpy()`, `.cpu()` of a CPU
    tensor), and collectives (`torch.distributed`'s functions), recorded whole. A collective's backend may finish it
    with ops of its own after its dispatched op (gloo's reduce-scatter copies its result out of a buffer of its own
    when it is waited for), which would replay on the capture's buffers; a device's graph holds the collective as one
    kernel, and so does this one: the call, waited for, is one recorded op, the ops inside it not recorded."""

    def __init__(self, placement: _Placement, recorder: _Recorder) -> None:
        super().__init__()
        self.placement, self.recorder = placement, recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            self.placement.refuse_read(f"Tensor.{name}()", [args[0]])
        if func is torch.autograd.grad:  # the backward it runs is captured too: this mode stays on for it
            from qvl.foundation.runtime import grad_with_mode_on

            return grad_with_mode_on(self, args, kwargs)
        if getattr(func, "__module__", "") != "torch.distributed.distributed_c10d":
            return func(*args, **kwargs)
        self.recorder.inside_collective += 1
        try:
            result = func(*args, **kwargs)
            _completed(result)
        finally:
            self.recorder.inside_collective -= 1
        self.recorder.graph.ops.append(RecordedOp(func=func, args=args, kwargs=kwargs, written=()))
        return _Waited(result) if callable(getattr(result, "wait", None)) else result


class _Waited:
    """An async collective's work, waited for where it was recorded: the caller's `wait()` (gloo's reduce-scatter
    copies its result out again at every wait) has nothing left to do."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


_THREAD = threading.local()  # the graph this thread captures (a capture is the thread's: its modes are)


def _capturing() -> RecordedGraph | None:
    return getattr(_THREAD, "graph", None)


class RecordedGraph:
    """Stands in for `torch.cuda.CUDAGraph` (the methods its callers use): see the module docstring."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.ops: list[RecordedOp] = []
        self._modes: tuple[_Recorder, _FunctionLevel] | None = None
        self._touched: tuple[torch.Tensor, ...] = ()
        self._pool: tuple[int, int] | None = None
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **kwargs: Any) -> None:
        if _capturing() is not None:
            raise RuntimeError("a CUDA graph capture is already under way on this thread")
        self.ops.clear()
        self._pool = pool if pool is not None else graph_pool_handle()
        placement = _Placement()
        recorder = _Recorder(self, placement)
        self._modes = (recorder, _FunctionLevel(placement, recorder))
        for mode in self._modes:
            mode.__enter__()
        _THREAD.graph = self

    def capture_end(self) -> None:
        if _capturing() is not self or self._modes is None:
            raise RuntimeError("capture_end without this graph's capture_begin")
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = None
        _THREAD.graph = None
        touched = {id(t): t for op in self.ops for t in pytree.tree_leaves((op.args, op.kwargs, op.written))
                   if isinstance(t, torch.Tensor)}  # fmt: skip
        self._touched = tuple(touched.values())  # what a replay writes or reads: their version counters kept

    def replay(self) -> None:
        if _capturing() is not None:
            raise RuntimeError("a graph cannot be replayed while another one is captured")
        with torch.no_grad(), torch.autograd.grad_mode._unsafe_preserve_version_counter(self._touched):
            for op in self.ops:
                op.run()
        self.replays += 1

    def reset(self) -> None:
        self.ops.clear()
        self._touched = ()

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("the graph has not been captured")
        return self._pool

    def register_generator_state(self, state: Any) -> None:
        """A graph-safe generator on a device; the CPU's generator draws anew at every replay anyway."""

    def instantiate(self) -> None:
        """`keep_graph=True`'s explicit step on a device; nothing to do here."""

    def enable_debug_mode(self) -> None:
        """A device's graph debugging; nothing to do here."""

    def debug_dump(self, path: str) -> None:
        with open(path, "w") as f:
            f.writelines(f"{op.func}\n" for op in self.ops)


class RecordedCapture:
    """Stands in for the `torch.cuda.graph` context manager: `graph.capture_begin()` on entry, `capture_end()` on
    exit (stream, pool and error mode accepted and left to the device)."""

    def __init__(self, cuda_graph: RecordedGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global", **kwargs: Any) -> None:  # fmt: skip
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc: object) -> None:
        self.cuda_graph.capture_end()


def graph_pool_handle() -> tuple[int, int]:
    """A new opaque pool token, as `torch.cuda.graph_pool_handle()` returns."""
    return (0, next(_POOLS))


def is_current_stream_capturing() -> bool:
    return _capturing() is not None


def is_capturing() -> bool:
    """Whether a CUDA graph capture is under way on this thread: a recorded one, or one on a CUDA device (asking
    torch.cuda where no device is would fail)."""
    if _capturing() is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def can_capture() -> bool:
    """Whether this process can capture CUDA graphs: a CUDA device, or recorded graphs on the CPU."""
    return torch.cuda.is_available() or patches.is_applied(GROUP)


@contextlib.contextmanager
def recorded_graphs() -> Iterator[None]:
    """CUDA graphs recorded and replayed on the CPU for the block (needs the CPU runtime, qvl.foundation.runtime)."""
    with patches.applied(GROUP):
        yield


# Replacement factories named by qvl.foundation.patches (group "cpu-cuda-graphs"): each gets the original.


def recorded_graph_class(original: Any) -> type:
    return RecordedGraph


def recorded_capture_class(original: Any) -> type:
    return RecordedCapture


def pool_handles(original: Any):
    return graph_pool_handle


def capturing_here(original: Any):
    return is_current_stream_capturing


def no_op(original: Any):
    return lambda *args, **kwargs: None


def empty_memory_stats(original: Any):
    """Megatron-Core's capture logs the allocator's figures; a CPU has none, so they read zero."""
    return lambda *args, **kwargs: {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0}


def generator_as_it_is(original: Any):
    """Megatron-Core makes a generator's state graph-safe through `graphsafe_get_state`, which only a device's
    generator has; the CPU's needs nothing."""
    return lambda gen: gen
