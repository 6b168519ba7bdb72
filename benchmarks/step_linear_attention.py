"""The step census's stand-ins for flash-linear-attention's kernels: Qwen3.5's Gated DeltaNet layers as a CUDA device
runs them.

On CUDA with `fla`, Megatron-Core's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net/gdn.py) calls two of fla's
Triton functions per layer, `causal_conv1d` and `chunk_gated_delta_rule`, and its three `@jit_fuser` helpers (input
split and l2norm, decay and beta, gated output norm) run compiled (benchmarks.compiled_regions; the l2norm is torch's
there, as `speed-gated-delta-l2norm` makes it). The CPU run has no
Triton, and qvl's torch kernels (qvl.kernels.torch_gated_delta) cut a pack into samples and chunks in Python: tens of
ops per chunk, none of them what a GPU runs. Here each fla function is one autograd Function that counts the kernels
fla 0.6 launches for it (its Python code, read kernel by kernel: `FORWARD` and `BACKWARD` below) with the bytes each
reads and writes at the real widths, and computes stand-in values (the values do not matter to the counts).

Bytes are the kernels' tensors read once and written once, at their dtypes (bf16 activations; the decays in fp32),
with the 64-token chunk's state `h` ([chunks, heads, K, V]) written forward and read back. The chunked delta rule's
matrix products inside those kernels are not counted as GEMM FLOPs: at Qwen3.5's widths (64-token chunks, 128-wide
heads) its bytes take longer than its FLOPs at the tensor cores' rate, so the step model times it by its bytes (an
ESTIMATE until a GPU profile times fla's kernels).

Megatron-Core passes a pack's `cu_seqlens`; fla lists the pack's chunks from it on the device (`prepare_chunk_indices`,
a read back to the host, once per pack: fla caches the list by the tensor), unless the caller gives the list
(`chunk_indices`) or the host bounds (`cu_seqlens_cpu`), as qvl's patch group `speed-gated-delta-sync-free` does.
Its chunk states' kernels also list the pack's chunk offsets on the device, once per pack (`OFFSETS`). A `gpu` test
(tests/test_step_linear_attention.py) profiles fla and fails where its launches differ from these counts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils.weak import WeakIdKeyDictionary

CHUNK = 64  # fla's chunk for the gated delta rule and the causal convolution (the default Megatron-Core takes)
# Bytes per element: activations in the training dtype (bf16), decays (g and its gradients) in fp32.
BF16, FP32 = 2, 4


@dataclass(kw_only=True, slots=True, frozen=True)
class Kernel:
    """One launch of fla's: the tensors it reads and writes, by name (`tensor_bytes`)."""

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


# fla 0.6's chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py) at a 64-token chunk, without the in-kernel
# l2norm (Megatron-Core normalizes q and k itself) and without carried state. Forward: the chunk-local cumsum of the
# decays, A zeroed, the fused k k^T + triangular solve, w and u, the chunk states h (and v_new), the output.
FORWARD = (
    Kernel(name="fla chunk_local_cumsum", reads=("g",), writes=("g",)),
    Kernel(name="fla zeros (A)", writes=("A",)),
    Kernel(name="fla kkt_solve", reads=("k", "g", "beta"), writes=("A",)),
    Kernel(name="fla recompute_w_u_fwd", reads=("k", "v", "beta", "A", "g"), writes=("k", "v")),
    Kernel(name="fla chunk_gated_delta_rule_fwd_h", reads=("k", "k", "v", "g"), writes=("h", "v")),
    Kernel(name="fla chunk_fwd_o", reads=("q", "k", "v", "h", "g"), writes=("v",)),
)
# Backward: w, u and the states again, dv within chunks, the states' gradients, dq dk dw dg (dg per K block, then
# summed), the WY representation's gradients, two adds and the reverse cumsum of dg.
BACKWARD = (
    Kernel(name="fla recompute_w_u_fwd", reads=("k", "v", "beta", "A", "g"), writes=("k", "v")),
    Kernel(name="fla chunk_gated_delta_rule_fwd_h", reads=("k", "k", "v", "g"), writes=("h", "v")),
    Kernel(name="fla chunk_bwd_dv_local", reads=("q", "k", "g", "v"), writes=("v",)),
    Kernel(name="fla chunk_gated_delta_rule_bwd_dhu", reads=("q", "k", "k", "g", "v", "v"), writes=("h", "v")),
    Kernel(
        name="fla chunk_bwd_dqkwg", reads=("q", "k", "v", "k", "g", "h", "v", "v", "h"), writes=("k", "k", "k", "g")
    ),  # fmt: skip
    Kernel(name="fla sum (dg)", reads=("g",), writes=("g",)),
    Kernel(
        name="fla prepare_wy_repr_bwd", reads=("k", "v", "beta", "g", "A", "k", "v"), writes=("k", "v", "beta", "g")
    ),  # fmt: skip
    Kernel(name="fla add_ (dk)", reads=("k", "k"), writes=("k",)),
    Kernel(name="fla add_ (dg)", reads=("g", "g"), writes=("g",)),
    Kernel(name="fla chunk_local_cumsum", reads=("g",), writes=("g",)),
)
# Per pack, fla's chunk states kernels also list each sub-sequence's first chunk on the device
# (`prepare_chunk_offsets`: diff, add and floor-divide for the ceiling, pad, cumsum), cached by the tensor's identity
# for the pack's later layers and the backward (fla/ops/utils/index.py, `tensor_cache`); the bytes are a few integers.
OFFSETS = tuple(Kernel(name=f"fla prepare_chunk_offsets ({op})") for op in ("diff", "add", "floor_divide", "fill",
                                                                               "copy", "cumsum"))  # fmt: skip
# fla 0.6's causal_conv1d (fla/modules/conv/triton/ops.py) with an activation and no bias: one kernel forward;
# backward the activation's input again, the gradient kernel, the weight gradient's per-chunk partials summed and cast.
CONV_FORWARD = (Kernel(name="fla causal_conv1d_fwd", reads=("x", "weight"), writes=("x",)),)
CONV_BACKWARD = (
    Kernel(name="fla causal_conv1d_fwd", reads=("x", "weight"), writes=("x",)),
    Kernel(name="fla causal_conv1d_bwd", reads=("x", "x", "x", "weight"), writes=("x", "weight partials")),
    Kernel(name="fla sum (conv dw)", reads=("weight partials",), writes=("weight32",)),
    Kernel(name="fla _to_copy (conv dw)", reads=("weight32",), writes=("weight",)),
)


def chunks(bounds: list[int]) -> int:
    """fla's 64-token chunks of a pack whose sub-sequences end at `bounds` (cu_seqlens)."""
    return sum(math.ceil((b - a) / CHUNK) for a, b in zip(bounds, bounds[1:]))


def delta_rule_bytes(*, tokens: int, heads: int, key: int, value: int, chunk_count: int) -> dict[str, int]:
    """The bytes of each named tensor of the chunked delta rule at real widths: `k` any [tokens, heads, key] one
    (q, k, w and their gradients), `v` any [tokens, heads, value] one (v, u, v_new, o, their gradients), `g` the decays
    [tokens, heads] (fp32), `beta`, `A` (a 64 x 64 block per chunk row), `h` the chunk states [chunks, heads, key,
    value]."""
    return {"q": tokens * heads * key * BF16, "k": tokens * heads * key * BF16, "v": tokens * heads * value * BF16,
            "g": tokens * heads * FP32, "beta": tokens * heads * BF16, "A": tokens * heads * CHUNK * BF16,
            "h": chunk_count * heads * key * value * BF16}  # fmt: skip


def conv_bytes(*, tokens: int, channels: int, width: int, chunk_count: int) -> dict[str, int]:
    """The bytes of the causal convolution's tensors at real widths: `x` any [tokens, channels] one, its `weight`
    [channels, width] (bf16; fp32 summed: `weight32`), and the per-chunk weight-gradient partials (fp32)."""
    return {"x": tokens * channels * BF16, "weight": channels * width * BF16, "weight32": channels * width * FP32,
            "weight partials": chunk_count * channels * width * FP32}  # fmt: skip


def charge(census, kernels: tuple[Kernel, ...], nbytes: dict[str, int]) -> None:
    """Count `kernels` in `census`, each with the bytes of the tensors it names (`nbytes`)."""
    for kernel in kernels:
        census.launch(kernel.name, sum(nbytes[name] for name in kernel.reads + kernel.writes))


class _Kernels(torch.autograd.Function):
    """One fla call: its forward kernels charged now, its backward ones when the gradients come. The output is a copy
    of the input it is shaped like (`like`: v, x) and the gradients zeros but that input's (the values do not matter
    to the counts)."""

    @staticmethod
    def forward(ctx, census, kernels, nbytes, like, *others):
        ctx.census, ctx.backward_kernels, ctx.nbytes = census, kernels[1], nbytes
        ctx.others = [(t.shape, t.dtype) for t in others]
        charge(census, kernels[0], nbytes)
        with census.paused():
            return like.detach().contiguous().clone()

    @staticmethod
    def backward(ctx, grad):
        charge(ctx.census, ctx.backward_kernels, ctx.nbytes)
        with ctx.census.paused():
            zeros = [torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.others]
            return None, None, None, grad.contiguous().clone(), *zeros


class FlaKernels:
    """fla's `chunk_gated_delta_rule` and `causal_conv1d` as the census counts them (see the module docstring)."""

    def __init__(self, census):
        self.census = census
        self._made = WeakIdKeyDictionary()  # per pack's cu_seqlens, what fla has made of it (its cache)

    def bounds(self, cu_seqlens: torch.Tensor | None, tokens: int, chunk_indices, cu_seqlens_cpu,
               offsets: bool = False) -> list[int]:  # fmt: skip
        """A pack's bounds, read for the counts (no op of the step's). Once per pack, fla's own read of them where the
        caller gives it neither the chunk list nor the host bounds, and (`offsets`) its chunk offsets' kernels."""
        if cu_seqlens is None:
            return [0, tokens]
        made = self._made.setdefault(cu_seqlens, set())
        if chunk_indices is None and cu_seqlens_cpu is None and "chunk list" not in made:
            made.add("chunk list")
            self.census.sync("fla prepare_chunk_indices")
        if offsets and "offsets" not in made:
            made.add("offsets")
            charge(self.census, OFFSETS, {})
        with self.census.paused(), torch._C.DisableTorchFunction():
            return [int(b) for b in cu_seqlens.tolist()]

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, **_):  # fmt: skip
        if initial_state is not None or output_final_state or use_qk_l2norm_in_kernel:
            raise NotImplementedError("the census counts fla's training call as Megatron-Core makes it")
        widths = self.census.widths.dims
        bounds = self.bounds(cu_seqlens, q.shape[1], chunk_indices, cu_seqlens_cpu, offsets=True)
        nbytes = delta_rule_bytes(tokens=q.shape[1], heads=q.shape[2], key=widths.get(k.shape[-1], k.shape[-1]),
                                  value=widths.get(v.shape[-1], v.shape[-1]), chunk_count=chunks(bounds))  # fmt: skip
        return _Kernels.apply(self.census, (FORWARD, BACKWARD), nbytes, v, q, k, g, beta), None

    def causal_conv1d(self, x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, **_):  # fmt: skip
        if bias is not None or initial_state is not None or output_final_state:
            raise NotImplementedError("the census counts fla's training call as Megatron-Core makes it")
        widths = self.census.widths.dims
        bounds = self.bounds(cu_seqlens, x.shape[1], chunk_indices, cu_seqlens_cpu)
        nbytes = conv_bytes(tokens=x.shape[1], channels=widths.get(x.shape[-1], x.shape[-1]), width=weight.shape[-1],
                            chunk_count=chunks(bounds))  # fmt: skip
        return _Kernels.apply(self.census, (CONV_FORWARD, CONV_BACKWARD), nbytes, x, weight), None


@contextlib.contextmanager
def fla_code_path(census):
    """Megatron-Core's Gated DeltaNet as it runs on CUDA with fla, its two kernels fla's as `FlaKernels` counts them,
    its l2norm the torch one, inside its compiled input preparation where Inductor writes its kernel (on CUDA with fla
    `speed-gated-delta-l2norm` puts it there: fla's own breaks that region; the census's training groups are a CUDA
    run's with fla, so it applies there too, and a `--baseline` census keeps this one). Entered before qvl's training
    groups wrap those kernels (`speed-gated-delta-sync-free`), as they wrap fla's."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    from qvl.kernels import torch_gated_delta

    kernels = FlaKernels(census)
    with (
        mock.patch.object(torch_gated_delta, "fla_usable", lambda: True),
        mock.patch.object(common, "HAVE_FLA", True),
        mock.patch.object(common, "l2norm", torch_gated_delta.l2norm),
        mock.patch.object(gdn, "causal_conv1d", kernels.causal_conv1d),
        mock.patch.object(gdn, "chunk_gated_delta_rule", kernels.chunk_gated_delta_rule),
    ):
        yield kernels
