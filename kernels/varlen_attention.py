"""Core attention on PyTorch SDPA, for runs without Transformer Engine (CPU, and GPUs without TE).

Megatron-Core's own `DotProductAttention` refuses packed sequences (THD, `cu_seqlens`); only TE's
attention handles them. `SDPAttention` is a drop-in `core_attention` for the local layer specs that
handles both layouts:
- SBHD: [s, b, heads, dim] with a causal, padding or arbitrary mask, as `DotProductAttention` does;
- THD: [tokens, heads, dim] with `packed_seq_params.cu_seqlens_q/kv`: each sub-sequence attends only to
  itself (causally for decoder self-attention, fully for a vision encoder's per-image blocks).
THD on a GPU runs PyTorch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention
kernels inside torch >= 2.10): one call for every sub-sequence of the pack, GQA and causality in the kernel, no
host sync. Elsewhere (CPU, fp32, old torch, attention dropout, a padded THD layout) it runs one SDPA call per
sub-sequence, so memory stays linear in the packed length. `varlen_usable` is that decision, on its own so it
can be tested without a GPU.

`use_varlen_vision_attention(provider)` gives the replicated HF vision towers of Qwen2-VL / Qwen2.5-VL the same
kernel through transformers' attention-function registry (`AttentionInterface.register`, an extension point, not
a patch): the towers already pass `cu_seqlens` to a flash-type attention function, so their per-window and
per-image blocks stop looping in Python on a GPU.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from qvl.foundation import graph_replay
from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from qvl.foundation.families import family_of_provider, family_of_vision_config

logger = logging.getLogger(__name__)

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
# transformers routes `cu_seqlens` to an attention function only when its registered name contains "flash".
HF_VARLEN_ATTENTION = "qvl_flash_varlen"
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256  # FlashAttention-2's limit


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen_attn and its keyword names, or None where this torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_supported(
    *, device_type: str, dtype: torch.dtype, head_dim: int, dropout_p: float = 0.0, padded_layout: bool = False
) -> bool:
    """Whether torch's varlen kernel can run a THD attention: CUDA, fp16/bf16, head dim <= 256, no attention
    dropout (the kernel has none), unpadded sub-sequences (padding would join a bidirectional block), torch >= 2.10."""
    return (
        device_type == "cuda"
        and dtype in _VARLEN_DTYPES
        and head_dim <= _VARLEN_MAX_HEAD_DIM
        and dropout_p == 0.0
        and not padded_layout
        and _varlen_kernel() is not None
    )


def varlen_usable(query: torch.Tensor, *, dropout_p: float = 0.0, padded_layout: bool = False) -> bool:
    """`varlen_supported` for a [tokens, heads, dim] query."""
    return varlen_supported(
        device_type=query.device.type,
        dtype=query.dtype,
        head_dim=query.shape[-1],
        dropout_p=dropout_p,
        padded_layout=padded_layout,
    )


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """[tokens, heads, dim] attention of every packed sub-sequence to itself in one varlen kernel call.

    Adapts to the kernel's keywords across torch versions: causality is `window_size=(-1, 0)` from 2.11 and
    `is_causal` in 2.10; without `enable_gqa` the KV heads are repeated; without `scale` the query is scaled."""
    kernel, names = _varlen_kernel()
    kwargs: dict[str, Any] = {}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if scale is not None:
        if "scale" in names:
            kwargs["scale"] = scale
        else:
            query = query * (scale * math.sqrt(query.shape[-1]))  # the kernel's default scale is 1/sqrt(dim)
    cu_q, cu_kv = (c.to(device=query.device, dtype=torch.int32) for c in (cu_seqlens_q, cu_seqlens_kv))
    return kernel(query, key, value, cu_q, cu_kv, int(max_seqlen_q), int(max_seqlen_kv), **kwargs)


class SDPAttention(DotProductAttention):
    """`DotProductAttention` with PyTorch SDPA underneath and support for packed (THD) sequences."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        if self.config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' only, got {self.config.softmax_type!r}; "
                "use Transformer Engine's attention for off-by-one or learnable softmax."
            )
        if self.config.window_size is not None:
            raise ValueError(
                f"SDPAttention has no sliding-window support (window_size={self.config.window_size}); "
                "use Transformer Engine's attention."
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention_bias; use Transformer Engine's attention.")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, packed_seq_params, causal, dropout_p)
            return self._padded(query, key, value, attention_mask, causal, dropout_p)

    def _sdpa(self, q_bhsd, k_bhsd, v_bhsd, mask, causal, dropout_p) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_bhsd,
            k_bhsd,
            v_bhsd,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal and mask is None,
            scale=self.softmax_scale,
            enable_gqa=k_bhsd.size(1) != q_bhsd.size(1),
        )

    def _padded(self, query, key, value, attention_mask, causal, dropout_p) -> torch.Tensor:
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:
            # Megatron masks mark positions to drop (True); SDPA's boolean masks mark positions to keep.
            mask = ~attention_mask.bool()
            if causal:
                sq, sk = q.size(2), k.size(2)
                mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        out = self._sdpa(q, k, v, mask, causal, dropout_p)
        # [b, h, s, d] -> [s, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _packed(self, query, key, value, params: PackedSeqParams, causal, dropout_p) -> torch.Tensor:
        padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
        if varlen_usable(query, dropout_p=dropout_p, padded_layout=padded):
            out = varlen_attention(
                query,
                key,
                value,
                params.cu_seqlens_q,
                params.cu_seqlens_kv,
                _given_or_longest(params.max_seqlen_q, params.cu_seqlens_q),
                _given_or_longest(params.max_seqlen_kv, params.cu_seqlens_kv),
                causal=causal,
                scale=self.softmax_scale,
            )
            return out.reshape(out.shape[0], -1)
        return self._packed_loop(query, key, value, params, causal, dropout_p)

    def _packed_loop(self, query, key, value, params: PackedSeqParams, causal, dropout_p) -> torch.Tensor:
        """One SDPA call per sub-sequence (CPU, fp32, dropout, padded layouts, torch < 2.10); inside a CUDA graph
        capture, which cannot read the bounds on the host, one masked call (`block_masked_attention`)."""
        unpadded = params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
        if unpadded and graph_replay.is_capturing():
            out = block_masked_attention(query, key, value, params.cu_seqlens_q, params.cu_seqlens_kv,
                                         causal=causal, scale=self.softmax_scale, dropout_p=dropout_p)  # fmt: skip
            return out.reshape(out.shape[0], -1)
        starts_q, lengths_q = _segments(params.cu_seqlens_q, params.cu_seqlens_q_padded)
        starts_kv, lengths_kv = _segments(params.cu_seqlens_kv, params.cu_seqlens_kv_padded)
        check_longest(lengths_q, params.max_seqlen_q)
        check_longest(lengths_kv, params.max_seqlen_kv)
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        for sq0, sq_len, sk0, sk_len in zip(starts_q, lengths_q, starts_kv, lengths_kv):
            if sq_len == 0:
                continue
            # [t, h, d] slices -> [1, h, t, d]
            q = query[sq0 : sq0 + sq_len].transpose(0, 1).unsqueeze(0)
            k = key[sk0 : sk0 + sk_len].transpose(0, 1).unsqueeze(0)
            v = value[sk0 : sk0 + sk_len].transpose(0, 1).unsqueeze(0)
            out[sq0 : sq0 + sq_len] = self._sdpa(q, k, v, None, causal, dropout_p)[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def block_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over packed blocks as one SDPA call whose mask keeps each row to its own block (causal: to the
    block's rows up to its own, the blocks of `cu_q` and `cu_k` then the same), `[tokens, heads, dim]` in and out.
    The mask is made on the device from the bounds, so nothing is read on the host (a CUDA graph capture of the
    per-block loop's path, which reads them); rows after the last bound are zero, as the loop leaves them. Memory
    grows with the square of the rows: for the captures of tests and CPU runs, not for a GPU's varlen kernel."""
    rows_q = torch.arange(q.shape[0], device=q.device)
    rows_k = torch.arange(k.shape[0], device=k.device)
    block_q = torch.searchsorted(cu_q[1:].contiguous(), rows_q.to(cu_q.dtype), right=True)
    block_k = torch.searchsorted(cu_k[1:].contiguous(), rows_k.to(cu_k.dtype), right=True)
    mask = block_q[:, None] == block_k[None, :]
    if causal:
        mask &= rows_k[None, :] <= rows_q[:, None]
    outside = rows_q >= cu_q[-1]
    mask |= outside[:, None]  # a row without keys would make NaNs, also in the gradients of the others
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )[0].transpose(0, 1)
    return out.masked_fill(outside[:, None, None], 0)


def check_longest(lengths: list[int], given: int | torch.Tensor | None) -> None:
    """Refuse a `max_seqlen` given as an int that is shorter than a block: the varlen kernel launches a row of
    programs per `max_seqlen` rows and would leave the block's end out. The per-block loop (CPU) reads the lengths
    anyway, so it checks what the GPU kernel is given (e.g. a CUDA-graphed tower's fixed longest block)."""
    if isinstance(given, int) and lengths and max(lengths) > given:
        raise ValueError(
            f"a packed block of {max(lengths)} rows is longer than the max_seqlen {given} given for it; "
            "give max_seqlen at least the longest block of cu_seqlens"
        )


def _max_length(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _given_or_longest(given: int | torch.Tensor | None, cu_seqlens: torch.Tensor) -> int | torch.Tensor:
    """The longest block as given (a Python int reads nothing back; a 0-d device tensor is read once, by the
    kernel call), else computed from `cu_seqlens`. Not `given or ...`: that reads a tensor's truth value too."""
    return _max_length(cu_seqlens) if given is None else given


def _segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """Start offsets (padded layout if given) and real lengths of each packed sub-sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist()
    return starts, lengths


def use_sdpa_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """Swap the core attention of a local (non-TE) transformer-layer spec for `SDPAttention`, in place."""
    attention = layer_spec.submodules.self_attention
    attention.submodules.core_attention = SDPAttention
    return layer_spec


def hf_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    is_causal: bool = False,
    packed_max_seqlens: tuple[tuple[torch.Tensor, int], ...] = (),
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function ([1, heads, tokens, dim] in, [1, tokens, heads, dim] out) over packed
    blocks: torch's varlen kernel where usable, else one SDPA call per block (CPU, fp32, dropout).

    `packed_max_seqlens`: (cu_seqlens tensor, its longest block) pairs computed on the host
    (qvl.kernels.speed_hf_vision passes them through the tower): for those tensors the kernel gets a Python int,
    where transformers' own `max_length_q` is a 0-d device tensor that would be read back in every block."""
    if query.shape[0] != 1 or cu_seq_lens_q is None or attention_mask is not None:
        raise ValueError(
            f"{HF_VARLEN_ATTENTION} attention serves packed vision blocks (batch 1, cu_seqlens, no mask); got batch "
            f"{query.shape[0]}, cu_seqlens {'missing' if cu_seq_lens_q is None else 'given'}, "
            f"mask {'given' if attention_mask is not None else 'none'}; use attn_implementation='sdpa' for this model"
        )
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    dropout_p = dropout if module.training else 0.0
    max_q = longest_block(cu_seq_lens_q, packed_max_seqlens, max_length_q)
    max_k = longest_block(cu_k, packed_max_seqlens, max_length_k)
    out = packed_attention(q, k, v, cu_seq_lens_q, cu_k, max_q, max_k, scaling, dropout_p, is_causal)
    return out.unsqueeze(0), None


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int | torch.Tensor | None,
    max_k: int | torch.Tensor | None,
    scaling: float | None,
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """Attention over packed blocks, `[tokens, heads, dim]` in and out: torch's varlen kernel where usable (with the
    longest blocks given, or computed), else one SDPA call per block (CPU, fp32, dropout)."""
    if varlen_usable(q, dropout_p=dropout_p):
        max_q = _max_length(cu_q) if max_q is None else max_q
        max_k = _max_length(cu_k) if max_k is None else max_k
        return varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=is_causal, scale=scaling)
    if graph_replay.is_capturing():  # the bounds cannot be read on the host
        return block_masked_attention(q, k, v, cu_q, cu_k, causal=is_causal, scale=scaling, dropout_p=dropout_p)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    check_longest([b - a for a, b in zip(bounds_q, bounds_q[1:])], max_q)
    check_longest([b - a for a, b in zip(bounds_k, bounds_k[1:])], max_k)
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]), strict=True):
        block = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        out[q0:q1] = block.transpose(0, 1)
    return out


def longest_block(
    cu_seqlens: torch.Tensor, known: tuple[tuple[torch.Tensor, int], ...], given: int | torch.Tensor | None
) -> int | torch.Tensor | None:
    """The longest block of `cu_seqlens`: the int handed in with that very tensor, else `given` (None: to compute)."""
    for tensor, longest in known:
        if tensor is cu_seqlens:
            return longest
    return given


def register_hf_varlen_attention() -> str:
    """Register `hf_varlen_attention` with transformers' attention-function registry (idempotent); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_VARLEN_ATTENTION, hf_varlen_attention)
    return HF_VARLEN_ATTENTION


def use_varlen_vision_attention(provider: Any) -> bool:
    """Have a provider's replicated HF vision tower (Qwen2-VL, Qwen2.5-VL) run `hf_varlen_attention`; True if it has one.

    The attention function is chosen after the model is built, in a pre-wrap hook (Megatron-Bridge's extension
    point): at build time transformers treats any "flash" name it does not know as a hub kernel to download. A
    Megatron vision tower (Qwen3-VL) already runs `SDPAttention`; nothing to do."""
    family = family_of_provider(provider)
    if family is None or family.megatron_vision_tower:
        return False
    register_hf_varlen_attention()
    provider.register_pre_wrap_hook(varlen_vision_towers)
    return True


def varlen_vision_towers(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook: every HF vision tower in the model chunks attends through `hf_varlen_attention`."""
    from transformers import PreTrainedModel

    for chunk in model:
        for module in chunk.modules():
            if (
                isinstance(module, PreTrainedModel)
                and module._supports_flash_attn  # its attention hands cu_seqlens to a flash-type function
                and family_of_vision_config(type(module.config).__name__) is not None
            ):
                _set_tower_attention(module, register_hf_varlen_attention())
    return model


def _set_tower_attention(tower: torch.nn.Module, implementation: str) -> None:
    """Point a built tower's attention at `implementation`. Its blocks read the implementation from the config
    object they share, at every forward; that object is the provider's vision_config (Megatron-Bridge builds the
    tower from it without a copy), so the tower gets its own copy: a later build from the provider's config must
    still pass transformers' checks, which treat an unknown "flash" name as a hub kernel to download."""
    shared = tower.config
    own = copy.deepcopy(shared)
    own._attn_implementation = implementation
    for module in tower.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
