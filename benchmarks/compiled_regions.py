"""Compiled regions in the step census: code that runs `torch.compile`d on a CUDA device, counted as Inductor builds it.

On CUDA, qvl compiles some regions (qvl.kernels.compiled; with `compile=True` each HF vision block) and
Megatron-Core compiles its `jit_fuser` functions (SwiGLU's `bias_activation_fusion`, the native fused cross-entropy);
the CPU run of the census executes them eagerly. `CompiledRegions.region(name, fn)` stands in for such a region: the first call of each signature (the
region, grad mode, and each tensor's dtype, rank and requires_grad) compiles `fn` with Inductor on the CPU (gcc) at
the census's tiny widths, in a thread of its own (no census mode, no checkpoint hook there), and counts the kernel
launches of the generated forward and backward code: every call of a generated kernel and every aten fallback in
each graph's `call()`. GEMMs (`extern_kernels.mm` ...) and attention are extern calls there, and the census keeps
counting them as it does outside a region (FLOPs, alignment). The region's bytes are what its generated graphs read
and write (`graph_io_bytes`: each tensor argument once, each buffer returned once), measured at the call it was
compiled for and carried to every call as the ratio to a model (inputs read and outputs written once; backward the
output gradients and saved inputs read, the input gradients written); plus, for a GEMM inside it, its result and its
activation operand once each (a fused kernel reads the one and writes the other).

Every call of a region then counts those kernels, once per forward run (a recomputed block runs its forward again)
and once per backward: the autograd nodes a region creates in forward get consecutive sequence numbers, and the
backward ops of those nodes (`torch._C._current_autograd_node()`) belong to it. But not the sum autograd's engine
makes when a node's gradient reaches a tensor that already has one from elsewhere (it runs under the node that
delivered last): where the receiving node is outside the region (the region's input, used outside it too), a CUDA
run adds the two with an eager kernel after the compiled backward, and the census counts that `add` as such; where
it is inside (a tensor the region uses twice), the sum is part of the compiled backward. Where Dynamo breaks a
region into several graphs (its graph-break reasons are in the JSON), the kernels of all of them count, and the autograd
Functions it broke at run eagerly, so their backward ops are counted one by one. The JSON lists each region under
"compiled_regions", marked "compiled-region (Inductor's CPU kernel count)". Triton's CUDA kernels can be fused
differently from gcc's loops; the counts are Inductor's plan for the graph on the CPU, not a CUDA measurement.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

LABEL = "compiled-region (Inductor's CPU kernel count)"
_VIEW_FALLBACKS = frozenset({"view", "reshape", "as_strided", "permute", "transpose", "expand", "select", "slice"})


@dataclass(kw_only=True, slots=True, frozen=True)
class RegionKernels:
    """Kernel launches of one region's generated code: forward graph(s), backward graph(s), graphs compiled; and the
    bytes its graphs read and write at the shapes it was measured with (`graph_io_bytes`; None where the code could
    not be read)."""

    forward: int
    backward: int
    graphs: int
    breaks: tuple[str, ...] = ()  # Dynamo's graph-break reasons (none when the region is one graph)
    forward_bytes: float | None = None
    backward_bytes: float | None = None


def kernel_calls(code: str) -> int:
    """Kernel launches in one Inductor output module: calls of its generated kernels and aten fallbacks (not views,
    not GEMMs or attention: extern calls the census counts itself) in its `call()`."""
    kernels = set(re.findall(r"^(\w+) = async_compile\.", code, re.MULTILINE))
    body = code[code.index("def call(") :] if "def call(" in code else ""
    calls = 0
    for line in body.splitlines():
        match = re.match(r"\s+(\w+)(?:\.run)?\(", line)
        if match and match.group(1) in kernels:
            calls += 1
        fallback = re.search(r"torch\.ops\.aten\.(\w+)\.", line)
        if fallback and fallback.group(1) not in _VIEW_FALLBACKS and "extern_kernels" not in line:
            calls += 1
    return calls


_ALLOCATION = re.compile(r"^\s+(\w+) = empty_strided_\w+\((\(.*?\)), \(.*?\), torch\.(\w+)\)", re.MULTILINE)
_REINTERPRET = re.compile(r"^\s+(\w+) = reinterpret_tensor\((\w+),", re.MULTILINE)
_SYMBOL = re.compile(r"^\s+(\w+) = (\w+)$", re.MULTILINE)
_ARGUMENT = re.compile(r"^\s+(\w+) = (?:rand_strided\((\(.*?\)), \(.*?\), device='\w+', dtype=torch\.(\w+)\)|(\d+))$",
                       re.MULTILINE)  # fmt: skip


def graph_io_bytes(code: str, shape: Callable[[tuple[int, ...]], tuple[int, ...]] = tuple) -> float | None:
    """Bytes one Inductor output module's graph reads and writes: every tensor argument once, and every buffer it
    allocates and returns once (a buffer returned twice, e.g. one gradient for two inputs, and a returned argument,
    e.g. a tensor saved for backward, are not written again); sizes from the module's `get_args()`, mapped by `shape`
    (the census's tiny widths to the real ones). None where the code is not in that form."""
    if "def call(" not in code or "def get_args(" not in code:
        return None
    call, arguments = code[code.index("def call(") :], code[code.index("def get_args(") :]
    values: dict[str, int] = {}
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, dims, dtype, number in _ARGUMENT.findall(arguments):
        if number:
            values[name] = int(number)
        else:
            tensors[name] = (tuple(int(d) for d in dims.strip("()").split(",") if d.strip()), dtype)
    for name, source in _SYMBOL.findall(call[: call.find("\n        return")]):
        if source in values:
            values[name] = values[source]

    def nbytes(dims: tuple[int, ...], dtype: str) -> int:
        return math.prod(shape(dims)) * getattr(torch, dtype).itemsize

    allocations = {}
    for name, dims, dtype in _ALLOCATION.findall(call):
        try:
            allocations[name] = (tuple(int(eval(d, {}, dict(values))) for d in _split_dims(dims)), dtype)  # noqa: S307
        except (NameError, SyntaxError, TypeError):
            return None
    bases = dict(_REINTERPRET.findall(call))
    returned = re.search(r"^\s+return \((.*)\)$", call, re.MULTILINE)
    if returned is None:
        return None
    written = set()
    for item in re.findall(r"reinterpret_tensor\((\w+)|(\w+)", returned.group(1)):
        name = item[0] or item[1]
        while name in bases:
            name = bases[name]
        if name in allocations:
            written.add(name)
    read = sum(nbytes(*tensors[name]) for name in tensors)
    return float(read + sum(nbytes(*allocations[name]) for name in written))


def _split_dims(dims: str) -> list[str]:
    return [d.strip() for d in dims.strip()[1:-1].split(",") if d.strip()]


def _clone_inputs(tree: Any) -> Any:
    """Detached copies with the same requires_grad; a tensor appearing twice stays one object (identity matters:
    qvl's attention finds a block length by the `cu_seqlens` tensor it was computed for)."""
    memo: dict[int, torch.Tensor] = {}

    def clone(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            copy = value.detach().clone()
            memo[id(value)] = copy.requires_grad_(value.requires_grad and copy.is_floating_point())
        return memo[id(value)]

    return pytree.tree_map(clone, tree)


def _grad_targets(fn: Callable, inputs: Any) -> list[torch.Tensor]:
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        tensors += [p for p in owner.parameters() if p.requires_grad]
    return list({id(t): t for t in tensors}.values())


def inductor_kernels(
    fn: Callable, args: tuple, kwargs: dict, *, grad: bool = True, fullgraph: bool = True, shape: Callable = tuple
) -> RegionKernels:
    """Compile `fn` with Inductor (this machine's backend) as one graph and count the kernel launches of its forward
    and (with `grad` and outputs that need one) backward code, and the bytes their graphs read and write (sizes
    mapped by `shape`). Raises if the region does not compile whole."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    args, kwargs = _clone_inputs((args, kwargs))
    with (
        mock.patch.object(GraphLowering, "save_output_code", codes.append),
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
        torch.set_grad_enabled(grad),
    ):
        torch._dynamo.reset()  # a graph cached from an earlier call would generate no code to count
        torch._dynamo.utils.counters.clear()
        out = torch.compile(fn, fullgraph=fullgraph, dynamic=True)(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        targets = _grad_targets(fn, (args, kwargs))
        if grad and outputs and targets:
            torch.autograd.grad(outputs, targets, [torch.ones_like(t) for t in outputs], allow_unused=True)
        breaks = tuple(sorted(torch._dynamo.utils.counters["graph_break"]))
        torch._dynamo.reset()
    backward = [c for c in codes if _is_backward(c)]
    forward = [c for c in codes if c not in backward]
    return RegionKernels(
        forward=sum(kernel_calls(c) for c in forward),
        backward=sum(kernel_calls(c) for c in backward),
        graphs=len(codes),
        breaks=breaks,
        forward_bytes=_summed(graph_io_bytes(c, shape) for c in forward),
        backward_bytes=_summed(graph_io_bytes(c, shape) for c in backward) if backward else None,
    )


def _summed(values) -> float | None:
    values = list(values)
    return None if not values or None in values else sum(values)


def _is_backward(code: str) -> bool:
    """A backward graph's `call()` takes the output gradients (AOTAutograd names them tangents_N); Inductor may
    compile it with the forward, before any backward runs."""
    head = code[code.index("def call(") :].split("args.clear()")[0] if "def call(" in code else ""
    return "tangents_" in head


def inductor_kernels_apart(
    fn: Callable, args: tuple, kwargs: dict, *, grad: bool, fullgraph: bool = True, opaque=None, shape: Callable = tuple
) -> RegionKernels:
    """`inductor_kernels` in a thread of its own: outside the caller's torch modes, saved-tensor hooks (a
    checkpointed block's) and grad mode, which are all per thread; `opaque` is a context entered there."""
    result: dict[str, Any] = {}

    def measure():
        try:
            with opaque() if opaque is not None else contextlib.nullcontext():
                result["kernels"] = inductor_kernels(fn, args, kwargs, grad=grad, fullgraph=fullgraph, shape=shape)
        except BaseException as error:  # re-raised in the caller's thread, with its cause
            result["error"] = error

    thread = threading.Thread(target=measure, name="census-inductor")
    thread.start()
    thread.join()
    if "error" in result:
        raise RuntimeError(f"Inductor could not compile the region {fn!r}") from result["error"]
    return result["kernels"]


class CompiledRegions:
    """Stand-ins for compiled regions in one census (see the module docstring)."""

    def __init__(self, census, *, opaque=None):
        self.census = census
        self.opaque = opaque  # a context that makes attention an opaque op for Inductor while measuring
        self.kernels: dict[tuple, RegionKernels] = {}
        self.ratios: dict[tuple, tuple[float, float]] = {}  # key -> graphs' bytes / the model's, forward and backward

    def region(self, name: str, fn: Callable, *, fullgraph: bool = True) -> Callable:
        """`fn` as the census counts it: one compiled region called `name` (compiled as qvl compiles it: `fullgraph`
        or not; the graphs Inductor made are in the JSON)."""

        def compiled_region(*args, **kwargs):
            census = self.census
            if torch.compiler.is_compiling() or census.suspended or census.compiled_depth:
                return fn(*args, **kwargs)  # traced or measured, or inside another region: part of that one
            key = self.key(name, args, kwargs)
            kernels = self.measured(key, fn, args, kwargs, fullgraph)
            grad = torch.is_grad_enabled()
            start = census.sequence_probe() if grad else None
            census.compiled_forward(name, kernels)
            census.compiled_depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                census.compiled_depth -= 1
            census.compiled_bytes(name, self.scaled_bytes(key, kernels, self.bytes(fn, (args, kwargs), out)))
            outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grad and outputs:
                census.compiled_backward_range(start, census.sequence_probe(), name, kernels, outputs)
            return out

        return compiled_region

    @staticmethod
    def key(name: str, args: tuple, kwargs: dict) -> tuple:
        """A region's signature: its name, grad mode, and each tensor's dtype, rank and requires_grad."""
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return name, torch.is_grad_enabled(), tuple((t.dtype, t.dim(), t.requires_grad) for t in leaves)

    def measured(self, key: tuple, fn: Callable, args: tuple, kwargs: dict, fullgraph: bool) -> RegionKernels:
        if key not in self.kernels:
            self.kernels[key] = inductor_kernels_apart(
                fn, args, kwargs, grad=key[1], fullgraph=fullgraph, opaque=self.opaque, shape=self.census.widths.shape
            )
        return self.kernels[key]

    def scaled_bytes(self, key: tuple, kernels: RegionKernels, model: tuple[float, float]) -> tuple[float, float]:
        """A call's (forward, backward) bytes: the model's (`bytes`) scaled by what the region's generated graphs
        read and write against the model at the call it was measured with (a region's tensors all grow with the
        rows, so the ratio holds for every call of it); the model's own where the graphs' bytes are unknown."""
        if key not in self.ratios:
            measured = (kernels.forward_bytes, kernels.backward_bytes)
            self.ratios[key] = tuple(m / b if m is not None and b else 1.0 for m, b in zip(measured, model))
        return model[0] * self.ratios[key][0], model[1] * self.ratios[key][1]

    def bytes(self, fn: Callable, inputs: Any, out: Any) -> tuple[float, float]:
        """(forward, backward) bytes as a model: inputs read and outputs written once; backward reads the output
        gradients and the saved inputs and writes the input gradients. `scaled_bytes` corrects it by what the
        generated graphs move (a saved intermediate instead of the inputs, one gradient for two inputs)."""
        nbytes = self.census.widths.nbytes
        tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        owner = getattr(fn, "__self__", None)
        params = list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []
        read = sum(nbytes(t) for t in tensors + params)
        written = sum(nbytes(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        grads = sum(nbytes(t) for t in tensors + params if t.requires_grad)
        return read + written, written + read + grads


# --- a CPU stand-in for torch's varlen attention kernel, opaque to Inductor -----------------------------------------


def _attend(query, key, value, cu_seqlens, causal: bool, scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        gqa = k.shape[0] != q.shape[0]
        out[start:end] = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
        ).transpose(0, 1)
    return out


@torch.library.custom_op("qvl_census::varlen_attention", mutates_args=())
def _varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    return _attend(query, key, value, cu_seqlens, causal, scale)


@_varlen_attention.register_fake
def _(query, key, value, cu_seqlens, causal, scale):
    return torch.empty_like(query)


@torch.library.custom_op("qvl_census::varlen_attention_backward", mutates_args=())
def _varlen_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: _attend(q, k, v, cu_seqlens, causal, scale), query, key, value)
    return vjp(grad)


@_varlen_attention_backward.register_fake
def _(grad, query, key, value, cu_seqlens, causal, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx, inputs, output):
    query, key, value, cu_seqlens, causal, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad):
    query, key, value, cu_seqlens = ctx.saved_tensors
    grads = _varlen_attention_backward(grad, query, key, value, cu_seqlens, ctx.causal, ctx.scale)
    return *grads, None, None, None


_varlen_attention.register_autograd(_backward, setup_context=_setup)


def cpu_varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None, **_):
    """torch's `varlen_attn` signature over a CPU custom op: one opaque call Inductor keeps as an extern kernel, as
    it keeps torch's own varlen op on CUDA (self-attention: the key blocks are the query blocks)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _varlen_attention(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)


VARLEN_NAMES = frozenset({"window_size", "scale"})


@contextlib.contextmanager
def opaque_varlen_attention():
    """qvl's attention takes the varlen path (as on CUDA) through `cpu_varlen_kernel`, for Inductor on the CPU."""
    from qvl.kernels import varlen_attention

    with (
        mock.patch.object(varlen_attention, "varlen_usable", lambda *args, **kwargs: True),
        mock.patch.object(varlen_attention, "_varlen_kernel", lambda: (cpu_varlen_kernel, VARLEN_NAMES)),
    ):
        yield


def bisect_range(ranges: list[tuple[int, int, Any]], sequence_nr: int) -> Any | None:
    """The payload of the (start, end, payload) range, sorted by start and disjoint, that holds `sequence_nr`."""
    index = bisect.bisect_right(ranges, sequence_nr, key=lambda r: r[0]) - 1
    if index >= 0 and ranges[index][0] < sequence_nr < ranges[index][1]:
        return ranges[index][2]
    return None


# Megatron-Core's `jit_fuser` (torch.compile) functions that run on CUDA with the recipes' settings, by module: SwiGLU's
# fusion (`bias_activation_fusion`, called inside its autograd Functions: forward and backward each one region), the
# Qwen3-VL vision tower's bias-GELU and bias-dropout-add (qvl.kernels.speed_qwen3_vl_tower.fuse_bias_ops) and the
# native fused cross-entropy (`cross_entropy_loss_fusion`, Megatron-Bridge's default; qvl's patch group
# "speed-cross-entropy" calls its own regions instead).
MEGATRON_JIT_FUNCTIONS = {
    "megatron.core.fusions.fused_bias_swiglu": ("SwiGLU", ("swiglu", "bias_swiglu", "swiglu_back", "bias_swiglu_back")),
    "megatron.core.fusions.fused_bias_gelu": ("bias-GELU", ("bias_gelu", "bias_gelu_back")),
    "megatron.core.fusions.fused_bias_dropout": ("bias-dropout-add", ("bias_dropout_add_fused_train",)),
    "megatron.core.fusions.fused_cross_entropy": (
        "Megatron cross-entropy",
        ("calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss", "calculate_gradients"),
    ),
}
# Megatron-Core's `@jit_fuser` methods: module -> (label, class, methods). Qwen3.5's gated attention output, and its
# Gated DeltaNet's input split and l2norm, decays and beta, and gated output norm.
MEGATRON_JIT_METHODS = {
    "megatron.core.transformer.attention": ("attention", "Attention", ("_apply_output_gate",)),
    "megatron.core.ssm.gated_delta_net.common": (
        "Gated DeltaNet",
        "_GDNBase",
        ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta", "_apply_gated_norm"),
    ),
}
# qvl.kernels.speed_cross_entropy's regions.
QVL_CROSS_ENTROPY_REGIONS = ("logits_max", "target_statistics", "logits_gradient")


@contextlib.contextmanager
def cuda_compiled_regions(census):
    """The regions a CUDA device with Triton runs compiled, as census stand-ins: qvl's compiled regions
    (qvl.kernels.compiled: the vision, LM and Qwen3-VL rotaries, the vision RMSNorm, MLP activations and bias
    gradients, the cross-entropy), each vision block with `compile=True` (qvl.kernels.speed_hf_vision), and Megatron-Core's `jit_fuser`
    functions (SwiGLU's, which qvl turns on there, qvl.foundation.megatron.no_te_settings, and the native fused
    cross-entropy where qvl's is not patched in; the Qwen3-VL vision tower's bias-GELU and bias-dropout-add). The
    language model's bias-dropout-add stays unfused on CUDA (Megatron-Bridge's default; without a bias and with
    dropout 0 the unfused path is already one add)."""
    import importlib

    from qvl.foundation import megatron
    from qvl.kernels import (
        compiled,
        hf_vision_mlp,
        speed_cross_entropy,
        speed_hf_vision,
        speed_rotary,
        torch_wgrad_accum,
    )

    regions = CompiledRegions(census, opaque=opaque_varlen_attention)
    region_names = {
        speed_hf_vision.rotary_fp32: "vision rotary",
        speed_hf_vision.rms_norm: "vision RMSNorm",
        speed_hf_vision.add_rms_norm: "vision add+RMSNorm",
        speed_hf_vision.add_layer_norm: "vision add+LayerNorm",
        speed_hf_vision.rotary_qkv_gradient: "vision rotary qkv gradient",
        speed_hf_vision.rotary_qkv_gradient_and_sum: "vision rotary qkv gradient and bias sum",
        hf_vision_mlp.silu_gate: "vision MLP silu_gate",
        hf_vision_mlp.silu_gate_gradient: "vision MLP silu_gate gradient",
        hf_vision_mlp.silu_gate_gradient_and_sums: "vision MLP silu_gate gradient and bias sums",
        hf_vision_mlp.quick_gelu_gradient: "vision MLP quick_gelu gradient",
        hf_vision_mlp.quick_gelu_gradient_and_sum: "vision MLP quick_gelu gradient and bias sum",
        hf_vision_mlp.quick_gelu: "vision MLP quick_gelu",
        speed_rotary.rotary_whole_pack: "LM rotary",
        speed_rotary.rotary_absolute: "Qwen3-VL rotary",
        torch_wgrad_accum.bias_gradient_into: "vision bias gradient",
        **{getattr(speed_cross_entropy, name): f"cross-entropy {name}" for name in QVL_CROSS_ENTROPY_REGIONS},
    }
    stand_ins: dict = {}

    def region(fn):  # every region qvl compiles, named (a new one is counted under its function's name)
        if fn not in stand_ins:
            stand_ins[fn] = regions.region(region_names.get(fn, fn.__qualname__), fn)
        return stand_ins[fn]

    def compile_block(block: torch.nn.Module) -> None:
        block.forward = regions.region("vision block", block.forward, fullgraph=False)  # as compile_block does

    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (compiled, "runs_compiled", lambda tensor: not torch.compiler.is_compiling()),
            (compiled, "compiled", region),
            (compiled, "cuda_compile_usable", lambda: True),
            (speed_hf_vision, "compile_block", compile_block),
            (megatron, "jit_fusions_usable", lambda: True),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        for module_name, (label, names) in MEGATRON_JIT_FUNCTIONS.items():
            module = importlib.import_module(module_name)
            for name in names:
                original = getattr(module, name)
                eager = getattr(original, "_torchdynamo_orig_callable", original)
                stack.enter_context(mock.patch.object(module, name, regions.region(f"{label} {name}", eager)))
        for module_name, (label, class_name, names) in MEGATRON_JIT_METHODS.items():
            owner = getattr(importlib.import_module(module_name), class_name)
            for name in names:
                # as `jit_fuser` (torch.compile) makes them: a graph break splits the region, it does not fail
                region = regions.region(f"{label} {name.strip('_')}", getattr(owner, name), fullgraph=False)
                stack.enter_context(mock.patch.object(owner, name, region))
        yield regions
