"""The census's hooks into torch, and its stand-ins for the CUDA kernels a CPU run computes another way.

`CensusFunctionMode` sees Python-level calls (host syncs by method, host-to-device copies, host factories, `F.rms_norm`)
and `CensusDispatchMode` every aten op after autograd; both report to a `benchmarks.step_census.Census`, which enters
them in `Census.tracking()`. The stand-ins count as CUDA runs them and compute what the CPU can:
- `FusedRmsNorm`: `F.rms_norm` as `_fused_rms_norm` forward and `_fused_rms_norm_backward` (CPU's composite runs
  pow/mean/rsqrt);
- `fake_varlen_kernel` and `VARLEN_NAMES`: torch's varlen attention kernel and the keywords it takes, one `FakeFlash`
  call per attention with the FLOPs the real kernel does (its head dim rounded up to a kernel's, `flash_head_dim`)
  and the kernels FlashAttention-2's path launches around it (`FLASH_BACKWARD_EXTRA` and the others);
- `dispatcher_host_copies`: Megatron-Core's all-to-all token dispatcher copying its counts to the host and waiting
  for them (on the CPU its copy is a no-op for a CPU tensor, and its wait an event stand-in's);
- `router_graph_waits`: the host's wait for a MoE layer's router graph under Megatron-Core's partial graphs.

Each takes the census as an argument and imports nothing of it, so `benchmarks.step_census` imports this module, not
the reverse.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation.graph_replay import HOST_READ_METHODS

# Factories whose tensor is on the host unless a device is given.
_FACTORIES = frozenset({"tensor", "arange", "zeros", "ones", "full", "empty", "as_tensor", "from_numpy", "linspace",
                        "randn", "rand", "randint", "eye"})  # fmt: skip


def _host_placed(args, kwargs) -> bool:
    """Whether a factory call puts its tensor on the host: no device, or the literal "cpu" (a `torch.device` here is
    the CPU standing in for CUDA, as in `device=x.device`)."""
    device = kwargs.get("device", next((a for a in args if isinstance(a, torch.device)), None))
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


class CensusFunctionMode(TorchFunctionMode):
    """Python-level events: host syncs by method, host-to-device copies, host factories, CUDA's fused RMSNorm."""

    def __init__(self, census):
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        census = self.census
        if census.suspended:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is F.rms_norm:  # CUDA runs one fused kernel each way; CPU's composite decomposes (layer_norm.cpp)
            bound = dict(zip(("input", "normalized_shape", "weight", "eps"), args)) | kwargs
            shape = tuple(bound["normalized_shape"])
            return FusedRmsNorm.apply(census, bound["input"], shape, bound.get("weight"), bound.get("eps"))
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
            return self._to(func, args, kwargs)
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            census.mark_host(args[0], pinned=True)
            return args[0]
        if name in HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor) and not census.is_host(args[0]):
            census.sync(f".{name.strip('_')}()")
            census.in_sync += 1
            try:
                return func(*args, **kwargs)
            finally:
                census.in_sync -= 1
        if name in _FACTORIES and _host_placed(args, kwargs):
            # A host tensor; built from device values (torch.tensor([t.norm() ...])) it reads each of them.
            device_values = [
                v for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor) and not census.is_host(v)
            ]
            if device_values:
                census.sync(f"torch.{name}(device values)", len(device_values))
            census.host_factory += 1
            try:
                result = func(*args, **kwargs)
            finally:
                census.host_factory -= 1
            census.mark_host(result)
            return result
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        census, tensor, cuda_call = self.census, args[0], func.__name__ == "cuda"
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device, int))), None))
        result = func(*args, **kwargs)
        explicit_cpu = isinstance(target, str) and target.startswith("cpu")
        if not cuda_call and (target is None or explicit_cpu):
            if explicit_cpu and not census.is_host(tensor):
                census.sync(".to('cpu')")
                census.mark_host(result)
            return result
        if census.is_host(tensor):
            # A host tensor sent to the device (here the CPU, elsewhere CUDA): a copy, pinned or pageable.
            census.h2d(tensor, pinned=tensor in census.pinned and bool(kwargs.get("non_blocking")))
            if result is tensor:
                with census.paused():
                    result = tensor.clone()
            census.host.pop(result, None)
        return result


class CensusDispatchMode(TorchDispatchMode):
    """Every aten op, after autograd: counted in the current region."""

    def __init__(self, census):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.census.suspended:
            self.census.op(func, args, kwargs, out)
        return out


# --- stand-in for torch's varlen flash attention (CUDA) -------------------------------------------------------------

# FlashAttention-2's kernels (torch's varlen attention on CUDA) are built for these head dims and run a head at the
# next one up (flash_api's HEADDIM_SWITCH): Qwen2.5-VL's vision heads of 80 and Qwen3.5-VL's of 72 do the work of 96.
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# FlashAttention-2's query tile (kBlockM) at these head dims: a sub-sequence of at most this many rows (a vision
# window) is one tile, run at a rate of its own; the census keeps those FLOPs apart (`attention_short_tflop`)
FLASH_QUERY_TILE = 128


def flash_head_dim(dim: int) -> int:
    """The head dim FlashAttention-2's kernel runs a head of `dim` at."""
    return next((d for d in FLASH_HEAD_DIMS if d >= dim), dim)


# The kernels torch's varlen attention launches besides FlashAttention-2's main ones. Forward: `varlen_attn`'s own
# RNG state (`torch.zeros` of 2 elements: a fill). Backward (aten/src/ATen/native/transformers/cuda/flash_attn/):
# dO.O's row sums, which also clear dQ's fp32 accumulator, before the kernel and dQ's conversion from it after
# (flash_bwd_launch_template.h, `run_flash_bwd_seqk_parallel`); with grouped-query heads, dK and dV summed over each
# group (flash_api.cpp, `mha_varlen_bwd`'s `at::sum_out`). torch 2.14's `varlen_attn` takes grouped heads
# (`enable_gqa`); on one without it, qvl repeats the KV heads before the call (qvl.kernels.varlen_attention), whose
# repeats and their gradients' sums the census then counts as the eager ops they are.
VARLEN_FORWARD_EXTRA = ("varlen_attn rng_state fill",)
FLASH_BACKWARD_EXTRA = ("flash_bwd_dot_do_o", "flash_bwd_convert_dq")
FLASH_GQA_BACKWARD_EXTRA = ("flash_bwd dK group sum", "flash_bwd dV group sum")


class FakeFlash(torch.autograd.Function):
    """One varlen attention call as the census sees it: the kernels torch's FlashAttention-2 path launches forward
    and backward, the real FLOPs; the output is a copy of the query (values do not matter to the counts)."""

    @staticmethod
    def forward(ctx, census, flops, short_flops, query, key, value):
        ctx.census, ctx.flops, ctx.short_flops = census, flops, short_flops
        ctx.shapes = (key, value)
        ctx.grouped = key.shape[1] != query.shape[1]
        census.attention(
            flops, [query, key, value], backward=False, extra=VARLEN_FORWARD_EXTRA, short_flops=short_flops
        )
        with census.paused():
            return query.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        census = ctx.census
        extra = FLASH_BACKWARD_EXTRA + (FLASH_GQA_BACKWARD_EXTRA if ctx.grouped else ())
        census.attention(2.5 * ctx.flops, [], backward=True, extra=extra, short_flops=2.5 * ctx.short_flops)  # ~2.5x
        key, value = ctx.shapes
        with census.paused():
            return None, None, None, grad.clone(), torch.zeros_like(key), torch.zeros_like(value)


# torch's CUDA RMSNorm backward (aten/src/ATen/native/cuda/layer_norm_kernel.cu, layer norm's kernels reused): the
# input gradient's kernel, then the weight gradient's (`LaunchGammaBetaBackwardCUDAKernel`), which over more than 64 Ki
# rows of a norm narrower than 32 columns per two SMs sums partial rows in a second kernel (`.sum(0)`).
GAMMA_PARTIAL_ROWS = 64 * 1024
SM_COUNT = 132  # H100 and H200 SXM


def rms_norm_weight_gradient_kernels(rows: int, width: int) -> int:
    """The kernels torch's CUDA RMSNorm backward launches for the weight's gradient."""
    return 2 if rows > GAMMA_PARTIAL_ROWS and width // 32 < SM_COUNT // 2 else 1


class FusedRmsNorm(torch.autograd.Function):
    """`F.rms_norm` as CUDA runs it: `_fused_rms_norm` forward; `_fused_rms_norm_backward`'s input-gradient kernel
    and, with a weight, its weight-gradient kernels (which read the output gradient and the input again); the values
    are CPU's."""

    @staticmethod
    def forward(ctx, census, x, shape, weight, eps):
        ctx.census, ctx.shape, ctx.eps = census, shape, eps
        ctx.save_for_backward(x, weight if weight is not None else torch.empty(0))
        with census.paused():
            out = F.rms_norm(x, shape, weight, eps)
        census.opaque("_fused_rms_norm", [x, weight, out])
        return out

    @staticmethod
    def backward(ctx, grad):
        census = ctx.census
        x, weight = ctx.saved_tensors
        weight = weight if weight.numel() else None
        with census.paused(), torch.enable_grad():
            leaves = [x.detach().requires_grad_()] + ([weight.detach().requires_grad_()] if weight is not None else [])
            out = F.rms_norm(leaves[0], ctx.shape, leaves[1] if weight is not None else None, ctx.eps)
            grads = torch.autograd.grad(out, leaves, grad)
        census.opaque("_fused_rms_norm_backward", [grad, x, weight, grads[0]])
        if weight is not None:
            census.opaque("_fused_rms_norm_backward weight", [grad, x, grads[1]])
            width = census.widths.dims.get(x.shape[-1], x.shape[-1])
            if rms_norm_weight_gradient_kernels(x.numel() // x.shape[-1], width) == 2:
                census.opaque("_fused_rms_norm_backward weight partial sums", [grads[1]])  # a few rows per block
        return None, grads[0], None, grads[1] if weight is not None else None, None


def fake_varlen_kernel(census):
    """A stand-in for `torch.nn.attention.varlen.varlen_attn` that counts one flash call per attention in `census`
    (a `benchmarks.step_census.Census`)."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), **kwargs):
        # the stand-in's own read, for its FLOPs (the kernel reads nothing back): no torch function sees it, neither
        # the census's sync count nor a recorded CUDA graph's capture (benchmarks.bench_step.replays_counted)
        with census.paused(), torch._C.DisableTorchFunction():
            lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        heads, dim = query.shape[1], flash_head_dim(census.widths.dims.get(query.shape[2], query.shape[2]))
        per_row = 4.0 * heads * dim * (0.5 if tuple(window_size) == (-1, 0) else 1.0)
        flops = per_row * sum(n * n for n in lengths)
        short = per_row * sum(n * n for n in lengths if n <= FLASH_QUERY_TILE)
        return FakeFlash.apply(census, flops, short, query, key, value)

    return varlen_attn


VARLEN_NAMES = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "scale", "window_size",
                          "enable_gqa", "return_aux"})  # fmt: skip


@contextlib.contextmanager
def dispatcher_host_copies(census):
    """The all-to-all token dispatcher as CUDA runs it: `maybe_move_tensor_to_cpu` of a device tensor one
    device-to-host copy (into pinned memory: non-blocking) whose result is a host tensor, and the wait at the
    dispatcher's sync point (`d2h_event.synchronize()`) a host sync."""
    from megatron.core.transformer.moe import token_dispatcher

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dtoh_and_synchronize = dispatcher._maybe_dtoh_and_synchronize  # upstream's, or a patch group's in its place

    copies = 0  # device-to-host copies made so far

    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        nonlocal copies
        if not isinstance(tensor, torch.Tensor) or census.is_host(tensor):
            return tensor
        copies += 1
        census.opaque("_to_copy (device to host)", [tensor])
        with census.paused():
            host = tensor.clone()
        census.mark_host(host, pinned=True)
        return host.numpy() if as_numpy else host

    def counted(self, point, tokens_per_expert=None):
        before = copies
        result = dtoh_and_synchronize(self, point, tokens_per_expert)
        # a wait is the host's where this layer's counts went to the host (at its copy point, this or an earlier one)
        self._census_copied = getattr(self, "_census_copied", False) or copies > before
        if self._census_copied and point == self.cuda_sync_point:
            census.sync("d2h_event.synchronize()")
            self._census_copied = False
        return result

    with (
        mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_host),
        mock.patch.object(dispatcher, "_maybe_dtoh_and_synchronize", counted),
    ):
        yield


@contextlib.contextmanager
def router_graph_waits(census):
    """A MoE layer's partial CUDA graphs as CUDA runs them: between its router's graph and its experts the host waits
    for the router's graph (`MoETransformerLayer._forward_mlp`: `_router_dtoh_event.synchronize()`, a host sync in
    every MoE layer and micro-batch), where the CPU's stand-in event waits for nothing."""
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    transition = MoETransformerLayer.transition_cudagraph_scope

    class RouterEvent:
        def record(self, *args, **kwargs) -> None:
            pass

        def synchronize(self) -> None:
            census.sync("_router_dtoh_event.synchronize()")

    def counted(self, mode):
        transition(self, mode)
        if mode == "partial":
            self._router_dtoh_event = RouterEvent()

    with mock.patch.object(MoETransformerLayer, "transition_cudagraph_scope", counted):
        yield
