"""What one aten op costs on the device, for the step census (benchmarks.step_census): the real widths of a tiny
model's tensors (`WidthMap`), a GEMM's FLOPs at those widths and whether its operands' row pitches suit Hopper's
kernels; the bytes an in-place op writes back on top of what it reads; and whether an op is a CPU backend's own work
inside a collective (NCCL's kernel stands for it)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


@dataclass(kw_only=True, slots=True)
class WidthMap:
    """Tiny width -> real width (dims), and tiny numel -> real numel for flat views of parameters and buffers."""

    dims: dict[int, int]
    numels: dict[int, int] = field(default_factory=dict)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The real shape of a tensor of tiny `shape`."""
        if len(shape) == 1 and shape[0] not in self.dims and shape[0] in self.numels:
            return (self.numels[shape[0]],)
        return tuple(self.dims.get(int(d), int(d)) for d in shape)

    def numel(self, tensor: torch.Tensor) -> int:
        return math.prod(self.shape(tuple(tensor.shape)))

    def nbytes(self, tensor: torch.Tensor) -> int:
        """The bytes of `tensor`'s distinct elements at the real widths: an expanded view (a stride of 0, as the index
        Megatron-Core's unpermute expands over the hidden width) reads each element once from memory."""
        shape = self.shape(tuple(tensor.shape))
        if 0 in shape:
            return 0
        try:
            strides = tensor.stride()
        except RuntimeError:  # a layout without strides (sparse)
            return math.prod(shape) * tensor.element_size()
        return math.prod(d for d, stride in zip(shape, strides, strict=True) if stride != 0) * tensor.element_size()

    def pitch(self, stride: int) -> int:
        return self.dims.get(int(stride), int(stride))


# In-place ops that overwrite their destination without reading it (counted once, as the write).
OVERWRITE_OPS = frozenset({"copy_", "zero_", "fill_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_",
                           "bernoulli_", "random_", "exponential_"})  # fmt: skip
# In-place ops that write a few rows of their destination: counted as the reads of what they are given and the
# rows they write (`partial_write_bytes`), not as the whole destination.
PARTIAL_WRITE_OPS = frozenset({"index_put_", "_index_put_impl_", "index_add_", "index_copy_", "index_fill_",
                               "scatter_", "scatter_add_", "scatter_reduce_", "masked_scatter_", "put_"})  # fmt: skip
# Those of them that add into the rows they write (read first): always, or where their `accumulate` argument is set.
ACCUMULATING_OPS = frozenset({"index_add_", "scatter_add_", "scatter_reduce_"})
ACCUMULATE_ARG_OPS = frozenset({"index_put_", "_index_put_impl_", "put_"})
# Arguments a schema marks written that the kernel leaves alone without a grad scaler (bf16 training has none):
# fused Adam unscales its gradients in place only when given `grad_scale`.
UNSCALED_ARGS = {"_fused_adam_": frozenset({"grads"}), "_fused_adamw_": frozenset({"grads"})}
ALIGN_BYTES = 16  # Hopper's TMA needs 16-byte row pitches; else cuBLAS falls back to align2/align4 sm80 kernels
# torch's multi-tensor kernels (ATen/native/cuda/MultiTensorApply.cuh, builds for CUDA 13 and newer, as torch 2.14's
# wheels are): one launch takes at most this many tensors per list depth (1 to 5 lists) and this many blocks of
# MULTI_TENSOR_CHUNK elements each; a tensor's chunks go on in the next launch where the blocks run out.
MULTI_TENSOR_MAX_TENSORS = (770, 448, 336, 252, 210)
MULTI_TENSOR_MAX_TENSORS_SCALAR_LIST = (672, 448, 336, 252, 210)
MULTI_TENSOR_MAX_BLOCKS = 2240
MULTI_TENSOR_CHUNK = 65536
# Fused optimizers: their tensor lists besides `state_steps` (a step count per tensor, not walked in chunks).
FUSED_OPTIMIZER_OPS = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})
# Multi-tensor reductions: a per-chunk kernel, then one kernel that finishes each tensor's result.
MULTI_TENSOR_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


_C10D_FILE = "distributed_c10d.py"


def in_collective() -> bool:
    """Whether an op runs inside torch.distributed's collective calls (a backend's work, e.g. Gloo's copy of a
    reduce-scatter at one rank, which NCCL does in place: nothing)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D_FILE):
            return True
        frame = frame.f_back
    return False


def read_and_written(func, name: str, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place op reads and then writes back (its schema's `a!` arguments): already counted once as
    inputs, they move their bytes a second time. Overwritten destinations (`copy_`, `out=`) are counted once, as
    inputs; a few rows written (`index_put_`) are `partial_write_bytes`'."""
    if name in OVERWRITE_OPS or name in PARTIAL_WRITE_OPS:
        return []
    unwritten = UNSCALED_ARGS.get(name, frozenset()) if kwargs.get("grad_scale") is None else frozenset()
    tensors = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write or arg.name in unwritten or arg.name == "out":
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        tensors += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return tensors


def nongemm_bytes(func, name: str, args, kwargs, widths: WidthMap, *, inputs, outputs, inplace: bool) -> float:
    """Bytes a non-GEMM op moves: its inputs, its outputs unless in place, and what an in-place op writes back
    (`read_and_written`); a few rows written, `partial_write_bytes`."""
    if name in PARTIAL_WRITE_OPS:
        return partial_write_bytes(func, name, args, kwargs, widths)
    tensors = inputs + ([] if inplace else outputs) + read_and_written(func, name, args, kwargs)
    return sum(widths.nbytes(t) for t in tensors)


def partial_write_bytes(func, name: str, args, kwargs, widths: WidthMap) -> float:
    """Bytes of an op of PARTIAL_WRITE_OPS: what it is given besides its destination (indices, values), and the
    destination's rows it writes, as many elements as its largest other tensor holds (the values or the indices),
    read too where it accumulates into them."""
    destination, *given = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rows = max((widths.numel(t) for t in given), default=0) * destination.element_size()
    accumulates = name in ACCUMULATING_OPS
    if name in ACCUMULATE_ARG_OPS:
        position = [arg.name for arg in func._schema.arguments].index("accumulate")
        accumulates = bool(args[position] if position < len(args) else kwargs.get("accumulate", False))
    return sum(widths.nbytes(t) for t in given) + rows * (2 if accumulates else 1)


def kernels_launched(func, name: str, args, kwargs, widths: WidthMap) -> int:
    """CUDA kernels an op launches: one, but for a `_foreach_*` or fused-optimizer op those of its multi-tensor apply
    at the real widths, on its fast route (tensors on one device, dense, one dtype per list: the step's lists are):
    torch's `multi_tensor_apply` walks the first list's tensors in chunks, launching whenever a launch's tensors or
    blocks are full; empty tensors are skipped (none at all: 0). The lists are the op's `Tensor[]` arguments and, out
    of place (it returns a list), its result; a reduction adds its finishing kernel."""
    if not name.startswith("_foreach") and name not in FUSED_OPTIMIZER_OPS:
        return 1
    lists, scalar_list = [], False
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        kind = str(arg.type)
        scalar_list = scalar_list or kind.startswith("List[number]") or kind.startswith("List[Scalar]")
        if kind.startswith("List[Tensor]") and value and arg.name != "state_steps":
            lists.append(value)
    if not lists:
        return 1
    reduction = name in MULTI_TENSOR_REDUCTIONS
    result_list = bool(func._schema.returns) and not reduction and name not in FUSED_OPTIMIZER_OPS
    depth = min(len(lists) + result_list, 5)
    max_tensors = (MULTI_TENSOR_MAX_TENSORS_SCALAR_LIST if scalar_list else MULTI_TENSOR_MAX_TENSORS)[depth - 1]
    launches = tensors = blocks = 0
    for tensor in lists[0]:
        chunks = math.ceil(widths.numel(tensor) / MULTI_TENSOR_CHUNK)
        if not chunks:
            continue
        tensors += 1
        for chunk in range(chunks):
            blocks += 1
            if (tensors == max_tensors and chunk == chunks - 1) or blocks == MULTI_TENSOR_MAX_BLOCKS:
                launches += 1
                blocks = 0
                tensors = 0 if chunk == chunks - 1 else 1
    launches += blocks > 0
    return launches + (reduction and launches > 0)


def row_pitch_aligned(tensor: torch.Tensor, widths: WidthMap) -> bool:
    """Whether every row pitch of a GEMM operand (the stride of its non-unit-stride matrix dimension) is a multiple
    of 16 bytes at the real widths."""
    if tensor.dim() < 2:
        return True
    s0, s1 = tensor.stride(-2), tensor.stride(-1)
    if tensor.shape[-1] == 1 or tensor.shape[-2] == 1:
        return True
    pitch = s0 if s1 == 1 else s1 if s0 == 1 else None
    if pitch is None:
        return False
    return widths.pitch(pitch) * tensor.element_size() % ALIGN_BYTES == 0


def gemm_flops(name: str, args, out, widths: WidthMap) -> tuple[float, list[torch.Tensor], tuple]:
    """(real FLOPs, matrix operands, (M, K, N, batch)) of one GEMM-class op."""
    if name in ("mm", "addmm", "addmm_", "_scaled_mm", "addbmm", "bmm", "baddbmm"):
        a, b = (args[1], args[2]) if name in ("addmm", "addmm_", "addbmm", "baddbmm") else (args[0], args[1])
        (m, k), n = widths.shape(tuple(a.shape[-2:])), widths.shape((b.shape[-1],))[0]
        batch = a.shape[0] if a.dim() == 3 else 1
        return 2.0 * batch * m * k * n, [a, b, out], (m, k, n, batch)
    if name == "_grouped_mm":  # groups along a 2-D operand's rows or columns (`offs`), or a batch of 3-D ones
        a, b = args[0], args[1]
        (m, k), n = widths.shape(tuple(a.shape[-2:])), widths.shape((b.shape[-1],))[0]
        batch = a.shape[0] if a.dim() == 3 and b.dim() == 3 else 1
        return 2.0 * batch * m * k * n, [a, b, out], (m, k, n, batch)
    if name == "convolution":
        weight = args[1]
        kernel = math.prod(widths.shape(tuple(weight.shape[1:])))
        return 2.0 * widths.numel(out) * kernel, [], (widths.numel(out), kernel, 1, 1)
    # convolution_backward: grad input and grad weight, each the forward's FLOPs
    grad_output, weight, mask = args[0], args[2], args[-1]
    kernel = math.prod(widths.shape(tuple(weight.shape[1:])))
    return 2.0 * widths.numel(grad_output) * kernel * sum(bool(m) for m in mask[:2]), [], (0, kernel, 0, 1)
