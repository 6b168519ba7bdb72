"""Core attention on PyTorch SDPA, for runs without Transformer Engine (CPU, and GPUs without TE).

Megatron-Core's own `DotProductAttention` refuses packed sequences (THD, `cu_seqlens`); only TE's
attention handles them. `SDPAttention` is a drop-in `core_attention` for the local layer specs that
handles both layouts:
- SBHD: [s, b, heads, dim] with a causal, padding or arbitrary mask, as `DotProductAttention` does;
- THD: [tokens, heads, dim] with `packed_seq_params.cu_seqlens_q/kv`: each sub-sequence attends only to
  itself (causally for decoder self-attention, fully for a vision encoder's per-image blocks).
THD runs one SDPA call per sub-sequence, so memory stays linear in the packed length and each call can
take the flash / memory-efficient kernel on a GPU (`is_causal=True`, no materialised mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


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
        starts_q, lengths_q = _segments(params.cu_seqlens_q, params.cu_seqlens_q_padded)
        starts_kv, lengths_kv = _segments(params.cu_seqlens_kv, params.cu_seqlens_kv_padded)
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
