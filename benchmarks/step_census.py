"""The step census: every aten op of one training step, counted on CPU as a CUDA device would run it.

Aten op counts do not depend on the width of a model or on the device it runs on (a CPU census of the H100 run in
benchmarks/RESULTS.md reproduced its profile's mm, neg, silu and pow counts exactly), so a model with the real layer
counts and tiny widths, fed packs of the real lengths and image sizes, shows what a GPU step launches. Widths are
put back analytically: every tiny width maps to one real width (`WidthMap`), so GEMM FLOPs, row pitches and the
bytes of each elementwise op are those of the real model.

Where CPU and CUDA take different code paths, the census takes the CUDA one (the stand-ins for CUDA's
kernels, and the torch modes that watch the step, are in benchmarks.step_kernels):
- packed attention is torch's varlen kernel on CUDA; here one stand-in call (`FakeFlash`) per attention, recorded
  as `_flash_attention_forward` / `_flash_attention_backward` with the FLOPs the real kernel does, and the small
  kernels that path launches with them (an RNG-state fill forward; dO.O's sums and dQ's conversion backward, and
  the group sums of dK and dV for grouped-query heads);
- `F.rms_norm` is `_fused_rms_norm` on CUDA (CPU's composite runs pow/mean/rsqrt);
- torch's Adam/AdamW default to foreach kernels on CUDA (CPU runs the per-tensor loop), each as many launches as
  CUDA's multi-tensor apply takes for its lists at the real widths (`op_costs.kernels_launched`);
- a `.to(device)` of a host tensor is a host-to-device copy (here the device is the CPU, so it would be free).

A tensor is "host" when it came from the loader or from a factory call without a device; everything computed from a
device tensor is on the device. Host syncs are reads of device values on the host (`.item()`, `.tolist()`,
`bool()`, `int()`, ops whose output size depends on values such as `nonzero` or boolean indexing), each with the
first call site outside torch.

This module holds the recorder: `Census`, its per-region `RegionCounts`, and call sites; the `WidthMap` back to real
widths and what one op costs there (GEMM FLOPs, row-pitch alignment, a tensor's bytes, the bytes an in-place op
writes back, a backend's work inside a collective) are benchmarks.op_costs'.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import pathlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks import step_kernels, step_linear_attention
from benchmarks.compiled_regions import LABEL, bisect_range
from benchmarks.op_costs import (
    WidthMap,
    gemm_flops,
    in_collective,
    kernels_launched,
    nongemm_bytes,
    row_pitch_aligned,
)
from qvl.foundation.graph_replay import VALUE_SIZED_OPS

REGIONS = ("lm", "vision", "loss", "optimizer", "other")
GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_grouped_mm",
                      "convolution", "convolution_backward"})  # fmt: skip
# Ops that allocate or describe memory without running a kernel.
NO_KERNEL_OPS = frozenset({
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "set_", "resize_", "lift_fresh",
    "is_pinned", "_pin_memory", "record_stream", "_has_compatible_shallow_copy_type", "is_same_size", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "_nested_tensor_from_mask_left_aligned", "detach_",
    "_record_function_enter_new", "_record_function_exit",
})  # fmt: skip
# Views whose schema declares no alias (autograd's reasons): a new tensor header, no kernel.
UNDECLARED_VIEW_OPS = frozenset({"_unsafe_view"})
_SKIP_FRAMES = (  # frames of torch and of the census itself: never the call site of a sync
    f"{pathlib.Path(torch.__file__).parent}",
    __file__,
    step_kernels.__file__,
    step_linear_attention.__file__,
    "contextlib.py",
    "/functools.py",
)


@dataclass(kw_only=True, slots=True)
class RegionCounts:
    """What one region of the step ran."""

    launches: collections.Counter = field(default_factory=collections.Counter)  # op name -> kernel-launching calls
    views: int = 0
    empty: int = 0  # ops on zero-element tensors (no kernel on CUDA)
    syncs: collections.Counter = field(default_factory=collections.Counter)  # "kind at site" -> count
    gemm_flops: float = 0.0
    gemm_flops_misaligned: float = 0.0
    gemm_shapes: collections.Counter = field(default_factory=collections.Counter)  # (op, M, K, N, aligned) -> calls
    attention_flops: float = 0.0
    attention_flops_short: float = 0.0  # of sub-sequences one FlashAttention query tile long at most (windows)
    nongemm_bytes: float = 0.0
    nongemm_bytes_by_op: collections.Counter = field(default_factory=collections.Counter)  # op or region -> bytes
    h2d_copies: int = 0
    h2d_pageable: int = 0
    h2d_bytes: float = 0.0
    largest_temporary_bytes: int = 0

    def summary(self) -> dict:
        return {
            "kernel_launching_ops": sum(self.launches.values()),
            "view_ops": self.views,
            "empty_ops": self.empty,
            "host_syncs": sum(self.syncs.values()),
            "gemm_tflop": round(self.gemm_flops / 1e12, 4),
            "gemm_misaligned_tflop": round(self.gemm_flops_misaligned / 1e12, 4),
            "attention_tflop": round(self.attention_flops / 1e12, 4),
            "attention_short_tflop": round(self.attention_flops_short / 1e12, 4),
            "nongemm_gb": round(self.nongemm_bytes / 1e9, 3),
            "nongemm_gb_by_op": {k: round(v / 1e9, 3) for k, v in self.nongemm_bytes_by_op.most_common(20)},
            "h2d_copies": self.h2d_copies,
            "h2d_pageable": self.h2d_pageable,
            "largest_temporary_gib": round(self.largest_temporary_bytes / 2**30, 3),
            "ops": dict(self.launches.most_common()),
        }


class Census:
    """The counts of one instrumented window, per region; `record()` is the context that counts."""

    def __init__(self, widths: WidthMap):
        self.widths = widths
        self.regions = {name: RegionCounts() for name in REGIONS}
        self.region = "other"
        self.counting = False  # placement is tracked from the start; ops are counted only while this is on
        self.suspended = 0
        self.host_factory = 0
        self.host = WeakIdKeyDictionary()
        self.pinned = WeakIdKeyDictionary()
        self.in_sync = 0  # inside a sync method (`.item()` ...): its aten op is that sync, not another one
        # compiled regions (benchmarks.compiled_regions): forward depth, backward ranges of autograd sequence numbers
        self.compiled_depth = 0
        self.compiled_ranges: list[tuple[int, int, list]] = []
        self._last_returned: tuple | None = None  # the region node that last returned its gradients (`_returned`)
        self._returned_by: dict[int, list] = {}  # a gradient's storage -> the region call that returned it
        self.compiled_regions: dict[str, dict] = {}
        self._probe_leaf = torch.zeros((), requires_grad=True)
        # the parts a CUDA run replays as CUDA graphs (the LM's layers; the HF tower is its whole "vision" region):
        # their ops, calls and the copies into their buffers (qvl.kernels.speed_cuda_graphs, qvl.kernels.tower_graphs)
        self.graphed = collections.Counter()
        self._graph_start: tuple[int, int] | None = None

    # --- tensor placement -------------------------------------------------------------------------------------

    def mark_host(self, tree: Any, pinned: bool = False) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self.host[leaf] = True
                if pinned:
                    self.pinned[leaf] = True

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self.host

    @contextlib.contextmanager
    def paused(self):
        """Ops inside are not counted (the stand-ins' own arithmetic)."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    @contextlib.contextmanager
    def tracking(self):
        """Follow every op run inside the block (function- and dispatch-level modes); `counting()` counts them."""
        with step_kernels.CensusFunctionMode(self), step_kernels.CensusDispatchMode(self):
            yield self

    @contextlib.contextmanager
    def counted(self):
        """Count the ops of the block (inside `tracking()`)."""
        self.counting = True
        try:
            yield self
        finally:
            self.counting = False

    # --- events -----------------------------------------------------------------------------------------------

    @property
    def counts(self) -> RegionCounts:
        return self.regions[self.region]

    def sync(self, kind: str, count: int = 1) -> None:
        if self.counting:
            self.counts.syncs[f"{kind} at {call_site()}"] += count

    def h2d(self, tensor: torch.Tensor, *, pinned: bool) -> None:
        if not self.counting:
            return
        counts = self.counts
        counts.h2d_copies += 1
        counts.h2d_pageable += 0 if pinned else 1
        counts.h2d_bytes += self.widths.nbytes(tensor)

    def graph_replay(self) -> None:  # one launch (a CPU run's recorded graphs replay their ops uncounted)
        if self.counting:
            self.counts.launches["cudaGraphLaunch"] += 1

    def attention(self, flops: float, tensors: list[torch.Tensor], backward: bool, extra: tuple[str, ...] = (),
                  short_flops: float = 0.0) -> None:  # fmt: skip
        """One attention kernel doing `flops` (`short_flops` of them on sub-sequences one query tile long at most),
        and the `extra` kernels its op launches with it (their time is the attention's, so they carry no bytes);
        counted inside a compiled region too, which calls it as an opaque op."""
        if not self.counting:
            return
        counts = self.counts
        counts.launches["_flash_attention_backward" if backward else "_flash_attention_forward"] += 1
        for name in extra:
            counts.launches[name] += 1
        counts.attention_flops += flops
        counts.attention_flops_short += short_flops

    def opaque(self, name: str, tensors: list) -> None:
        """One kernel the CPU run computes another way (a stand-in's): counted with its bytes (inside a compiled
        region, Inductor's kernels stand for it)."""
        self.launch(name, sum(self.widths.nbytes(t) for t in tensors if t is not None))

    def launch(self, name: str, nbytes: float) -> None:
        """One kernel of a stand-in's that moves `nbytes` at the real widths (not inside a compiled region)."""
        if self.counting and not (self.compiled_depth or self._in_compiled_backward()):
            self.counts.launches[name] += 1
            self.counts.nongemm_bytes += nbytes
            self.counts.nongemm_bytes_by_op[name] += nbytes

    def op_totals(self) -> tuple[int, int]:
        """(kernel-launching ops, view ops) counted so far, over every region."""
        regions = self.regions.values()
        return sum(sum(c.launches.values()) for c in regions), sum(c.views for c in regions)

    def graph_begin(self) -> None:
        """A part a CUDA run replays as a graph starts (its forward, or its backward)."""
        if self.counting:
            self._graph_start = self.op_totals()

    def graph_end(self, part: str) -> None:
        """That part ends: its ops are tallied under `part`."""
        if self.counting and self._graph_start is not None:
            (launches, views), (start_launches, start_views) = self.op_totals(), self._graph_start
            self.graphed[f"{part}_launching_ops"] += launches - start_launches
            self.graphed[f"{part}_view_ops"] += views - start_views
            self._graph_start = None

    def sequence_probe(self) -> int:
        """The sequence number the next autograd node gets (a probe node takes this one)."""
        with self.paused(), torch.enable_grad():
            return (self._probe_leaf * 1).grad_fn._sequence_nr()

    def _compiled_stats(self, name: str) -> dict:
        return self.compiled_regions.setdefault(
            name, {"count": LABEL, "forward_kernels": 0, "backward_kernels": 0, "forward_runs": 0, "backward_runs": 0}
        )

    def compiled_forward(self, name: str, kernels) -> None:
        """One forward run of a compiled region (benchmarks.compiled_regions), counted where it starts: a compiled
        graph runs whole, also when non-reentrant checkpointing stops its eager recompute early."""
        if not self.counting:
            return
        self.counts.launches[f"compiled-region:{name}"] += kernels.forward
        stats = self._compiled_stats(name)
        stats["forward_kernels"], stats["backward_kernels"] = kernels.forward, kernels.backward
        stats["graphs"], stats["graph_breaks"] = kernels.graphs, list(kernels.breaks)
        stats["forward_runs"] += 1

    def compiled_bytes(self, name: str, nbytes: tuple[float, float]) -> None:
        """A compiled region's forward bytes, and those its backward will move."""
        if self.counting:
            self.counts.nongemm_bytes += nbytes[0]
            self.counts.nongemm_bytes_by_op[f"compiled-region:{name}"] += nbytes[0]
            self._compiled_stats(name)["_backward_bytes"] = nbytes[1]

    def compiled_backward_range(self, start: int, end: int, name: str, kernels, outputs=()) -> None:
        """The autograd nodes of one region call: sequence numbers strictly between `start` and `end`; each of those
        reached from its `outputs` tells the census when it has returned its gradients (`_returned`)."""
        call = [name, kernels, False]
        self.compiled_ranges.append((start, end, call))
        for node in _nodes_between(outputs, start, end):
            receivers = [edge[0]._sequence_nr() if edge[0] is not None else None for edge in node.next_functions]
            node.register_hook(functools.partial(self._returned, node._sequence_nr(), call, receivers))  # not node

    def _returned(self, sequence_nr: int, call: list, receivers: list, grad_inputs, grad_outputs) -> None:
        """A node of the region call `call` has returned its gradients, for the nodes `receivers`: what the engine
        runs under it now adds them to gradients other nodes gave the same tensors, in the receivers' buffers."""
        pointers = [g.untyped_storage().data_ptr() if isinstance(g, torch.Tensor) else None for g in grad_inputs]
        self._last_returned = (sequence_nr, call, pointers, receivers)
        self._returned_by.update((pointer, call) for pointer in pointers if pointer is not None)

    def _summed_outside(self, sequence_nr: int, args, out) -> bool:
        """Whether an op under the region node `sequence_nr` is the engine's sum of a gradient that node returned
        with one from outside its region call (on CUDA an eager kernel after the compiled backward). A sum into a
        node of the same call, or with gradients the same call returned (or sums that hold one: the compiled
        backward sums those first), is inside its compiled backward."""
        returned = self._last_returned
        if returned is None or returned[0] != sequence_nr:
            return False  # the node's own backward
        _, call, pointers, receivers = returned
        operands = _storages(args)
        into = [
            receiver for pointer, receiver in zip(pointers, receivers) if pointer is not None and pointer in operands
        ]
        if not into:
            return False
        inside = all(receiver is not None and bisect_range(self.compiled_ranges, receiver) is call for receiver in into)
        others = [storage for storage in operands if storage not in pointers]
        outside = not inside and any(self._returned_by.get(storage) is not call for storage in others)
        self._returned_by.update((storage, call) for storage in _storages(out))  # the sum holds this call's part
        return outside

    def _in_compiled_backward(self, args=(), out=None) -> bool:
        node = torch._C._current_autograd_node()
        if node is None or not self.compiled_ranges:
            return False
        sequence_nr = node._sequence_nr()
        payload = bisect_range(self.compiled_ranges, sequence_nr)
        if payload is None or (payload[1].breaks and _eager_function_node(node)):
            return False  # outside, or an autograd Function Dynamo broke the region's graph at: it runs eagerly
        if self._summed_outside(sequence_nr, args, out):
            return False
        name, kernels, charged = payload
        if not charged and self.counting:
            payload[2] = True
            stats = self._compiled_stats(name)
            self.counts.launches[f"compiled-region:{name}"] += kernels.backward
            self.counts.nongemm_bytes += stats.get("_backward_bytes", 0.0)
            self.counts.nongemm_bytes_by_op[f"compiled-region:{name}"] += stats.get("_backward_bytes", 0.0)
            stats["backward_runs"] += 1
        return True

    def _compiled_gemm_bytes(self, name: str, args, out) -> float:
        """A GEMM inside a compiled region: a fused kernel reads its result and wrote its activation operand."""
        operand = args[1] if name in ("addmm", "addbmm", "baddbmm") else args[0]
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if isinstance(operand, torch.Tensor):
            tensors.append(operand)
        return sum(self.widths.nbytes(t) for t in tensors)

    def op(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if (inputs and all(self.is_host(t) for t in inputs)) or (self.host_factory and not inputs):
            self.mark_host(outputs)
            return  # host-side tensor work: not on the device
        if not self.counting:
            return
        counts = self.counts
        if func.namespace == "c10d":  # collectives: kernels on the device's stream (NCCL), no host wait
            counts.launches[name] += 1
            return
        if in_collective():  # the CPU backend's own copies (Gloo at one rank): NCCL's collective stands for them
            return
        if self.compiled_depth or self._in_compiled_backward(args, out):  # Inductor's kernels stand for all but GEMMs
            if name in GEMM_OPS:
                counts.launches[name] += 1
                self._gemm(name, args, kwargs, out, counts)
                nbytes = self._compiled_gemm_bytes(name, args, out)
                counts.nongemm_bytes += nbytes
                counts.nongemm_bytes_by_op["GEMMs in compiled regions (epilogues)"] += nbytes
            return
        returns = func._schema.returns
        if name in UNDECLARED_VIEW_OPS or any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            counts.views += 1
            return
        if name in NO_KERNEL_OPS:
            return
        if returns and not all("Tensor" in str(r.type) for r in returns):  # "Tensor", "List[Tensor]", ...
            if inputs and not self.in_sync:
                counts.syncs[f"{name} at {call_site()}"] += 1  # a device value returned as a Python number
            return
        inplace = bool(returns) and all(r.alias_info is not None and r.alias_info.is_write for r in returns)
        if not inplace and outputs and all(t.numel() == 0 for t in outputs) and not name.startswith("_foreach"):
            counts.empty += 1
            return
        kernels = kernels_launched(func, name, args, kwargs, self.widths)
        if not kernels:  # a multi-tensor op whose tensors are all empty
            counts.empty += 1
            return
        counts.launches[name] += kernels
        if name in VALUE_SIZED_OPS or (
            name in ("index", "index_put", "index_put_") and _bool_index(args) and not _scalar_value(name, args)
        ):
            counts.syncs[f"{name} at {call_site()}"] += 1
        if name in GEMM_OPS:
            self._gemm(name, args, kwargs, out, counts)
            return
        nbytes = nongemm_bytes(func, name, args, kwargs, self.widths, inputs=inputs, outputs=outputs, inplace=inplace)
        counts.nongemm_bytes += nbytes
        counts.nongemm_bytes_by_op[name] += nbytes
        if self.region == "optimizer" and not inplace:
            counts.largest_temporary_bytes = max(
                counts.largest_temporary_bytes, sum(self.widths.nbytes(t) for t in outputs)
            )

    def _gemm(self, name: str, args, kwargs, out, counts: RegionCounts) -> None:
        flops, operands, key = gemm_flops(name, args, out, self.widths)
        aligned = all(row_pitch_aligned(t, self.widths) for t in operands)
        counts.gemm_flops += flops
        if not aligned:
            counts.gemm_flops_misaligned += flops
        counts.gemm_shapes[(name, *key, aligned)] += 1

    # --- results ----------------------------------------------------------------------------------------------

    def summary(self, packs: int) -> dict:
        """Per-step totals, per-region figures and per-pack non-GEMM bytes, JSON-ready."""
        total = RegionCounts()
        for counts in self.regions.values():
            _add(total, counts)
        gemm = total.gemm_flops
        syncs = collections.Counter()
        for counts in self.regions.values():
            syncs.update(counts.syncs)
        regions = {name: {k: v for k, v in stats.items() if not k.startswith("_")}
                   for name, stats in self.compiled_regions.items()}  # fmt: skip
        return {
            "packs": packs,
            "compiled_regions": regions,
            "step": total.summary()
            | {
                "misaligned_gemm_flop_share": round(total.gemm_flops_misaligned / gemm, 4) if gemm else 0.0,
                "nongemm_gb_per_pack": round(total.nongemm_bytes / 1e9 / packs, 2),
                "ops": dict(total.launches.most_common()),
            },
            "regions": {name: counts.summary() for name, counts in self.regions.items()},
            "sync_sites": dict(syncs.most_common()),
            "gemm_shapes": [
                {"op": k[0], "m": k[1], "k": k[2], "n": k[3], "batch": k[4], "aligned": k[5], "calls": n}
                for k, n in sorted(total.gemm_shapes.items(), key=lambda kv: -kv[1])
            ],
        }


def _add(total: RegionCounts, counts: RegionCounts) -> None:
    total.launches.update(counts.launches)
    total.syncs.update(counts.syncs)
    total.gemm_shapes.update(counts.gemm_shapes)
    total.nongemm_bytes_by_op.update(counts.nongemm_bytes_by_op)
    for name in ("views", "empty", "gemm_flops", "gemm_flops_misaligned", "attention_flops", "attention_flops_short",
                 "nongemm_bytes", "h2d_copies", "h2d_pageable", "h2d_bytes"):  # fmt: skip
        setattr(total, name, getattr(total, name) + getattr(counts, name))
    total.largest_temporary_bytes = max(total.largest_temporary_bytes, counts.largest_temporary_bytes)


def _storages(tree: Any) -> list[int]:
    """The storage addresses of the tensors in `tree`."""
    return [t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nodes_between(outputs, start: int, end: int) -> list:
    """The autograd nodes with sequence numbers strictly between `start` and `end` that `outputs` lead back to."""
    nodes, seen = [], set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        sequence_nr = node._sequence_nr()
        if sequence_nr in seen or not start < sequence_nr < end:
            continue
        seen.add(sequence_nr)
        nodes.append(node)
        stack.extend(edge[0] for edge in node.next_functions if edge[0] is not None)
    return nodes


def _eager_function_node(node) -> bool:
    """A custom autograd Function's backward node (not one of the census's own stand-ins for CUDA kernels)."""
    forward_class = getattr(node, "_forward_cls", None)
    return forward_class is not None and forward_class not in (step_kernels.FakeFlash, step_kernels.FusedRmsNorm)


def _scalar_value(name: str, args) -> bool:
    """`x[mask] = scalar`: index_put_ runs it as masked_fill_, with no host read (TensorAdvancedIndexing.cpp)."""
    return name.startswith("index_put") and len(args) > 2 and args[2].numel() == 1


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
    )


def call_site() -> str:
    """The innermost frame outside torch and the census (this module, benchmarks.step_kernels): "path:line in
    function"."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.name in ("__torch_function__", "__torch_dispatch__") or frame.filename.startswith(_SKIP_FRAMES):
            continue
        if "_python_dispatch" not in frame.filename:
            return f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"
    return "torch"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/qvl/", "/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
