"""Gated DeltaNet layers that read nothing back to the host: a pack's bounds given on the host (patch group
"speed-gated-delta-sync-free" of qvl.foundation.patches).

Megatron-Core 0.19.2's `GatedDeltaNet.forward` (megatron/core/ssm/gated_delta_net/gdn.py) checks a packed (THD)
batch's `cu_seqlens` on the host in every layer: `_resolve_cu_seqlens` (common.py) reads the last bound
(`.cpu().item()`) and whether every length divides by the context-parallel size (`.any()` in an `if`), once for the
query's bounds and once for the key's, and `torch.equal` compares the two (torch's CUDA `equal` computes and reads back
even for one tensor given twice). Five waits for the GPU per layer and micro-batch (counted on the CPU: tests), 240
per micro-batch for Qwen3.5-VL-27B's 48 Gated DeltaNet layers, twice that under full recompute; at each the GPU runs
dry while the host catches up. flash-linear-attention's kernels then list every sub-sequence's 64-token chunks
(`prepare_chunk_indices`) from the lengths on the device: one more read per micro-batch (fla keeps the list for the
later layers by the tensor's identity).

qvl's loader has the bounds on the host. Where this group is applied, the forward step (qvl.training.step) builds a
pack's `cu_seqlens` as a `HostBoundsCuSeqlens`: the device tensor as always, with its values on the host (`host`) and
its chunk list (`chunks`, made on the host and copied with the batch). Then:
- `_resolve_cu_seqlens` makes its checks on the host values, as Python numbers (a failed one calls upstream's, which
  raises its message);
- `torch.equal` of two such tensors compares their host values (a rule of the type, as the rotary's whole-pack fact
  is one of `WholePackCuSeqlens`, which it extends);
- fla's `causal_conv1d` and `chunk_gated_delta_rule`, as `GatedDeltaNet` calls them, are given the host bounds and
  the chunk list (`cu_seqlens_cpu`, `chunk_indices`: fla's own arguments for them).
The same kernels run on the same inputs: the numbers are those of upstream's path, bit for bit. A tensor without host
values takes upstream's path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from qvl.kernels.speed_rotary import WholePackCuSeqlens

GROUP = "speed-gated-delta-sync-free"

# fla's chunk size for the gated delta rule and its causal convolution (both functions' default, the one
# Megatron-Core's calls take)
CHUNK = 64

_EQUAL = frozenset({torch.equal, torch.Tensor.equal})


class HostBoundsCuSeqlens(WholePackCuSeqlens):
    """A whole pack's `cu_seqlens` on its device with the same values on the host, as numbers (`bounds`) and as a CPU
    tensor (`host`), and fla's list of its 64-token chunks on the device (`chunks`): made by `with_host_bounds`. A
    copy or an alias keeps them."""

    bounds: tuple[int, ...]
    host: torch.Tensor
    chunks: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _EQUAL and not kwargs and len(args) == 2 and all(isinstance(a, HostBoundsCuSeqlens) for a in args):
            return args[0].bounds == args[1].bounds
        result = super().__torch_function__(func, types, args, kwargs)
        if isinstance(result, HostBoundsCuSeqlens):  # `clone`, `detach`: the same bounds
            result.bounds, result.host, result.chunks = args[0].bounds, args[0].host, args[0].chunks
        return result


def chunk_list(host_cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """fla's `prepare_chunk_indices(cu_seqlens, chunk)` computed on the host: for every `chunk`-token chunk of every
    sub-sequence, in order, [sub-sequence, chunk within it] ([chunks, 2], `host_cu_seqlens`' dtype); a zero-length
    sub-sequence has none."""
    lengths = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).long()
    counts = (lengths + chunk - 1) // chunk
    sequence = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(sequence.numel()) - first[sequence]
    return torch.stack([sequence, within], 1).to(host_cu_seqlens.dtype)


def with_host_bounds(cu_seqlens: torch.Tensor, host: torch.Tensor, chunks: torch.Tensor) -> HostBoundsCuSeqlens:
    """`cu_seqlens` (a whole pack's, on its device: the same storage) as a `HostBoundsCuSeqlens` with `host`, its
    values on the host (a CPU tensor), and `chunks`, `chunk_list(host)` on the device."""
    if host.device.type != "cpu":
        raise ValueError(f"host bounds must be on the host (a CPU tensor); got one on {host.device}")
    marked = cu_seqlens.as_subclass(HostBoundsCuSeqlens)
    marked.bounds, marked.host, marked.chunks = tuple(host.tolist()), host, chunks
    return marked


# Replacement factories for patch group "speed-gated-delta-sync-free" (qvl.foundation.patches).


def checked_on_host(original: Callable) -> Callable:
    """Replacement factory for `_GDNBase._resolve_cu_seqlens`: upstream's checks on the host values where the bounds
    carry them; upstream's own call (and its error) where a check fails or they carry none."""

    @functools.wraps(original)
    def _resolve_cu_seqlens(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size: int = 1):
        cu_seqlens = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens_actual
        if isinstance(cu_seqlens, HostBoundsCuSeqlens):
            bounds = cu_seqlens.bounds
            if bounds[-1] == total_seq_len and all((b - a) % cp_size == 0 for a, b in zip(bounds, bounds[1:])):
                return cu_seqlens
        return original(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size)

    return _resolve_cu_seqlens


def given_chunks(original: Callable | None) -> Callable:
    """Replacement factory for fla's `causal_conv1d` and `chunk_gated_delta_rule` as Megatron-Core's gdn.py calls
    them: bounds that carry host values give the kernel those (`cu_seqlens_cpu`) and their chunk list
    (`chunk_indices`), which it would otherwise make from the device lengths; a kernel without those arguments (fla
    before 0.6) is called as upstream calls it."""
    takes = _named_parameters(original) & {"cu_seqlens_cpu", "chunk_indices"}

    @functools.wraps(original)
    def kernel(*args, cu_seqlens=None, **kwargs):
        if isinstance(cu_seqlens, HostBoundsCuSeqlens):
            given = {"cu_seqlens_cpu": cu_seqlens.host, "chunk_indices": cu_seqlens.chunks}
            kwargs = {name: value for name, value in given.items() if name in takes} | kwargs
        return original(*args, cu_seqlens=cu_seqlens, **kwargs)

    return kernel


def _named_parameters(function: Callable | None) -> set[str]:
    """The parameters `function` names (none for None or a callable without a signature)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()
