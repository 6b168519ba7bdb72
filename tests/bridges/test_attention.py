"""SDPAttention against a naive per-sequence softmax attention, and a packed GPT forward against
per-sequence forwards. fp32; tolerance 1e-5 absorbs summation-order differences between SDPA's math
kernel and the explicit softmax."""

from __future__ import annotations

import math

import pytest
import torch

from qvl.foundation import distributed


def naive_attention(q, k, v, causal: bool) -> torch.Tensor:
    """[s, h, d] inputs (k/v may have fewer heads) -> [s, h*d] by explicit softmax."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], -1)


@pytest.fixture
def attention_factory(cpu_runtime):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from qvl.bridges.attention import SDPAttention

    distributed.init_distributed()

    def make(causal: bool, heads: int = 4, groups: int = 2, head_dim: int = 8) -> SDPAttention:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            num_query_groups=groups,
            attention_dropout=0.0,
            **cpu_runtime.cpu_safe_config_overrides(),
        )
        mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
        return SDPAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")

    yield make
    distributed.destroy_distributed()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_attention_equals_per_sequence(attention_factory, causal):
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = attention_factory(causal)
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(total, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(total, 2, 8, generator=gen, requires_grad=True)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    packed = attention(q, k, v, attention_mask=None, packed_seq_params=params)
    expected = torch.cat([naive_attention(q[a:b], k[a:b], v[a:b], causal) for a, b in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    # Gradients flow to every token and stay within their own sub-sequence.
    packed[: lengths[0]].sum().backward()
    assert q.grad[lengths[0] :].abs().sum() == 0 and k.grad[lengths[0] :].abs().sum() == 0
    assert q.grad[: lengths[0]].abs().sum() > 0


def test_padded_thd_layout_ignores_padding_tokens(attention_factory):
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = attention_factory(causal=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)  # each sub-sequence padded to a multiple of 4
    q, k, v = (torch.randn(8, h, 8) for h in (4, 2, 2))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
    )
    out = attention(q, k, v, attention_mask=None, packed_seq_params=params)
    torch.testing.assert_close(out[0:3], naive_attention(q[0:3], k[0:3], v[0:3], True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[4:8], naive_attention(q[4:8], k[4:8], v[4:8], True), rtol=1e-5, atol=1e-5)
    assert out[3].abs().sum() == 0  # a padding slot produces nothing


def test_sbhd_causal_matches_naive(attention_factory):
    attention = attention_factory(causal=True)
    q, k, v = (torch.randn(6, 2, h, 8) for h in (4, 2, 2))  # [s, b, h, d]
    out = attention(q, k, v, attention_mask=None)
    for b in range(2):
        torch.testing.assert_close(out[:, b], naive_attention(q[:, b], k[:, b], v[:, b], True), rtol=1e-5, atol=1e-5)


def test_sbhd_megatron_mask_marks_dropped_positions(attention_factory):
    attention = attention_factory(causal=False)
    q, k, v = (torch.randn(5, 1, h, 8) for h in (4, 2, 2))
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 3:] = True  # Megatron convention: True = masked out (keys 3 and 4 are padding)
    out = attention(q, k, v, attention_mask=mask)
    torch.testing.assert_close(out[:, 0], naive_attention(q[:, 0], k[:3, 0], v[:3, 0], False), rtol=1e-5, atol=1e-5)


def test_packed_gpt_forward_equals_per_sequence_forward(cpu_runtime):
    """A whole Megatron GPTModel (RoPE restarts per sub-sequence) on a THD pack vs each sequence alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests import megatron_smoke as smoke

    distributed.init_distributed()
    try:
        shape = smoke.TinyGPT(num_layers=2, seq_length=32)
        model = smoke.build_model(shape).eval()
        lengths = [7, 12, 5]
        gen = torch.Generator().manual_seed(3)
        sequences = [torch.randint(0, shape.vocab_size, (n,), generator=gen) for n in lengths]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        tokens = torch.cat(sequences)[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
        )
        with torch.no_grad():
            packed = model(tokens, positions, attention_mask=None, packed_seq_params=params)
            alone = [model(s[None], torch.arange(len(s))[None], attention_mask=None) for s in sequences]
    finally:
        distributed.destroy_distributed()
    torch.testing.assert_close(packed[0], torch.cat([a[0] for a in alone]), rtol=1e-5, atol=1e-5)
