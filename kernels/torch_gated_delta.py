"""Gated DeltaNet without flash-linear-attention: PyTorch kernels for Megatron-Core's `GatedDeltaNet`.

Megatron-Core 0.19.2's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net/) takes three kernels from
flash-linear-attention (`fla`, Triton, GPU only): `causal_conv1d`, `chunk_gated_delta_rule` and `l2norm`, each
called with `cu_seqlens` for packed (THD) input. Without `fla` its constructor raises, and with `fla` installed on
a machine without a GPU the import succeeds but every kernel fails at its first launch. Its own torch fallback
(`torch_chunk_gated_delta_rule`, deterministic mode) refuses `cu_seqlens`, and transformers' fallbacks ignore it, so
a pack's recurrent state would flow from one sample into the next.

The kernels here are varlen: the sequence is cut at every `cu_seqlens` boundary and each piece runs from a zero
conv window and a zero recurrent state, exactly as a sample run on its own. The delta rule per piece is
Megatron-Core's own `torch_chunk_gated_delta_rule` (transformers' Qwen3-Next algorithm, 64-token chunks).

`GatedDeltaNet` below is Megatron-Core's module with these kernels swapped in for the duration of each call (patch
group `torch-gated-delta`, qvl.foundation.patches). Layer specs pick it where `fla` cannot run (`fla_usable()`);
on a GPU with `fla` installed they keep Megatron-Core's class and the real kernels
(`pip install flash-linear-attention`, https://github.com/fla-org/flash-linear-attention).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core.ssm.gated_delta_net import common as upstream_common
from megatron.core.ssm.gated_delta_net import gdn as upstream_gdn

from qvl.foundation import patches
from qvl.foundation.errors import QvlError

PATCH_GROUP = "torch-gated-delta"


class GatedDeltaError(QvlError, RuntimeError):
    """A Gated DeltaNet call the torch kernels do not support."""


def fla_usable() -> bool:
    """Whether flash-linear-attention's kernels can run here: installed, and a CUDA device to launch them on."""
    return bool(upstream_common.HAVE_FLA) and torch.cuda.is_available()


def sequence_bounds(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of every packed sub-sequence; the whole sequence when `cu_seqlens` is None."""
    if cu_seqlens is None:
        return [(0, total)]
    cuts = [int(c) for c in cu_seqlens.tolist()]
    if cuts[0] != 0 or cuts[-1] != total or any(b < a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise GatedDeltaError(f"cu_seqlens {cuts} does not cut a sequence of {total} tokens; it must run 0..{total}")
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, **_) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over `dim`, in fp32 and back, as fla.modules.l2norm computes it."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _no_cache(initial_state, output_final_state: bool, kernel: str) -> None:
    if initial_state is not None or output_final_state:
        raise GatedDeltaError(
            f"{kernel}: carried state (initial_state / output_final_state) is for cached inference, which qvl's "
            "torch kernels do not run; install flash-linear-attention on a GPU for it"
        )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """Depthwise causal conv over x [b, s, d] with weight [d, w], restarted at every `cu_seqlens` boundary."""
    _no_cache(initial_state, output_final_state, "causal_conv1d")
    if activation not in (None, "silu", "swish"):
        raise GatedDeltaError(f"causal_conv1d: activation {activation!r} is not supported; use 'silu' or None")
    width = weight.shape[-1]
    kernel = weight.unsqueeze(1)  # [d, 1, w]: one filter per channel
    pieces = []
    for start, end in sequence_bounds(cu_seqlens, x.shape[1]):
        # Each piece on its own, activation included: a sample's output is then the same numbers packed or alone.
        piece = x[:, start:end].transpose(1, 2).contiguous()  # [b, d, s]
        out = F.conv1d(piece, kernel, bias, padding=width - 1, groups=piece.shape[1])[..., : end - start]
        pieces.append((F.silu(out) if activation else out).transpose(1, 2))
    y = torch.cat(pieces, dim=1)
    return y, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """The gated delta rule over q, k [b, s, h, dk], v [b, s, h, dv], g and beta [b, s, h]; the recurrent state
    starts from zero at every `cu_seqlens` boundary."""
    _no_cache(initial_state, output_final_state, "chunk_gated_delta_rule")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise GatedDeltaError(f"chunk_gated_delta_rule: scale={scale} is not 1/sqrt(head_dim); leave it None")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    pieces = []
    for start, end in sequence_bounds(cu_seqlens, q.shape[1]):
        out, _ = upstream_common.torch_chunk_gated_delta_rule(
            *(t[:, start:end] for t in (q, k, v, g, beta)), initial_state=None, output_final_state=False
        )
        pieces.append(out)
    return torch.cat(pieces, dim=1), None


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """The gated delta rule token by token in fp32 (transformers' `torch_recurrent_gated_delta_rule`, bit for bit),
    restarted at every `cu_seqlens` boundary. Slower than the chunked rule, and its decay-gate gradients are
    within fp32 rounding of the exact ones where the chunked rule's are not: at real models' log-decays (near -18 per
    token) its gradient of g is ~1e-5 off, and a model's gate parameters sum those into 1e-3 (tests;
    docs/parity.md). For checks of those gradients (`GatedDeltaNet.use_recurrence`)."""
    _no_cache(initial_state, output_final_state, "recurrent_gated_delta_rule")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise GatedDeltaError(f"recurrent_gated_delta_rule: scale={scale} is not 1/sqrt(head_dim); leave it None")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    pieces = [
        _recurrence(*(t[:, start:end] for t in (q, k, v, g, beta)))
        for start, end in sequence_bounds(cu_seqlens, q.shape[1])
    ]
    return torch.cat(pieces, dim=1), None


def _recurrence(q, k, v, g, beta) -> torch.Tensor:
    """One sequence [b, s, h, d] from a zero state, in transformers' order of operations (fp32)."""
    dtype = q.dtype
    q, k, v, beta, g = (x.transpose(1, 2).contiguous().float() for x in (q, k, v, beta, g))
    q = q * (1 / q.shape[-1] ** 0.5)
    state = q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    out = []
    for t in range(k.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(dim=-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(dim=-2))
    return torch.stack(out, dim=2).transpose(1, 2).contiguous().to(dtype)


def token_by_token(model: list) -> list:
    """Pre-wrap hook: every GatedDeltaNet of the model chunks on the token-by-token rule where `fla` cannot run
    (`GatedDeltaNet.use_recurrence`); returns the chunks."""
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, GatedDeltaNet):
                module.use_recurrence()
    return model


# Replacement factories for patch group "torch-gated-delta" (qvl.foundation.patches).


def fla_present(original):
    return True


def torch_l2norm(original):
    return l2norm


def torch_causal_conv1d(original):
    return causal_conv1d


def torch_chunk_gated_delta_rule(original):
    return chunk_gated_delta_rule


def _eager(method):
    """The function under Megatron-Core's `jit_fuser` (torch.compile): compiling for CPU costs more than it saves
    on these small element-wise helpers, and a compiled graph would keep the kernels it first saw."""
    return getattr(method, "_torchdynamo_orig_callable", method)


_UPSTREAM = upstream_gdn.GatedDeltaNet
_EAGER_HELPERS = ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta", "_apply_gated_norm")


class GatedDeltaNet(upstream_gdn.GatedDeltaNet):
    """Megatron-Core's GatedDeltaNet; where `fla` cannot run, on the torch kernels above (any device)."""

    def __init__(self, *args, **kwargs):
        with contextlib.nullcontext() if fla_usable() else patches.applied(PATCH_GROUP):
            super().__init__(*args, **kwargs)
        # Upstream creates conv1d, dt_bias and A_log on `torch.cuda.current_device()` explicitly, which ignores a
        # `torch.device("meta")` context; qvl's streamed import (qvl.bridges.stream) builds the model on meta.
        default_device = torch.empty(0).device
        if default_device.type == "meta":
            self.to(default_device)
        if not fla_usable():
            for name in _EAGER_HELPERS:
                setattr(self, name, types.MethodType(_eager(getattr(_UPSTREAM, name)), self))

    def use_recurrence(self) -> None:
        """Where `fla` cannot run, compute the delta rule token by token (`recurrent_gated_delta_rule`) instead of in
        64-token chunks: for checks of the decay-gate gradients (qvl.training.parity); on a GPU with `fla` its own
        kernels stay, and are what such a check measures."""
        if not fla_usable():
            self.gated_delta_rule = recurrent_gated_delta_rule

    def forward(self, *args, **kwargs):
        with contextlib.nullcontext() if fla_usable() else patches.applied(PATCH_GROUP):
            return super().forward(*args, **kwargs)
