"""SDPAttention against a naive per-sequence softmax attention, and a packed GPT forward against
per-sequence forwards. fp32; tolerance 1e-5 absorbs summation-order differences between SDPA's math
kernel and the explicit softmax."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from qvl.foundation import distributed
from tests.numerics import assert_equal_up_to_summation_order


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

    from qvl.kernels.varlen_attention import SDPAttention

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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_inside_a_graph_capture_packed_blocks_are_one_masked_call_that_reads_nothing_back(attention_factory, causal):
    """A CUDA graph cannot hold the per-block loop's host reads of the bounds: captured, the packed path is one SDPA
    call masked to each row's block (a zero-length block, GQA, and rows after the last bound, which stay zero), the
    loop's values and gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.foundation.graph_replay import recorded_graphs
    from qvl.kernels.varlen_attention import packed_attention

    attention = attention_factory(causal)
    cu = torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, heads, 8, generator=gen) for heads in (4, 2, 2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    results = []
    for capture in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with recorded_graphs():
            context = torch.cuda.graph(torch.cuda.CUDAGraph()) if capture else nullcontext()
            with context:  # a capture refuses any read of the bounds on the host
                out = attention(*leaves, attention_mask=None, packed_seq_params=params)
                hf = packed_attention(*(t.detach() for t in leaves), cu, cu, 9, 9, None, 0.0, causal)
                out.square().sum().backward()
        results.append((out.detach(), hf.reshape(out.shape), *(t.grad for t in leaves)))
    for what, loop, masked in zip(("out", "hf out", "dq", "dk", "dv"), *results, strict=True):
        assert_equal_up_to_summation_order(masked[:17], loop[:17], what=what)
    assert results[1][0][17:].abs().sum() == 0 and results[1][1][17:].abs().sum() == 0


def test_a_longest_block_given_shorter_than_a_block_is_refused(attention_factory):
    """The varlen kernel takes `max_seqlen` as given and would leave the end of a longer block out; the per-block
    loop (CPU) reads the lengths and refuses it, for both of qvl's packed attentions."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels.varlen_attention import packed_attention

    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = (torch.randn(15, h, 8) for h in (4, 2, 2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=9)
    message = "a packed block of 9 rows is longer than the max_seqlen 8 given for it"
    with pytest.raises(ValueError, match=message):
        attention_factory(False)(q, k, v, attention_mask=None, packed_seq_params=params)
    with pytest.raises(ValueError, match=message):
        packed_attention(q, k, k.clone(), cu, cu, 8, 9, None, 0.0, False)
    assert packed_attention(q, k, k.clone(), cu, cu, 9, None, None, 0.0, False).shape == (15, 4, 8)


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


@pytest.mark.parametrize(
    ("change", "usable"),
    [
        ({}, True),
        ({"device_type": "cpu"}, False),
        ({"dtype": torch.float32}, False),
        ({"dtype": torch.float16}, True),
        ({"head_dim": 512}, False),
        ({"dropout_p": 0.1}, False),
        ({"padded_layout": True}, False),
    ],
    ids=["cuda-bf16", "cpu", "fp32", "fp16", "head-dim-512", "dropout", "padded-thd"],
)
def test_varlen_kernel_is_chosen_only_where_it_can_run(change, usable):
    from qvl.kernels.varlen_attention import _varlen_kernel, varlen_supported

    base = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=128, dropout_p=0.0, padded_layout=False)
    assert _varlen_kernel() is not None  # torch 2.14.1 ships torch.nn.attention.varlen
    assert varlen_supported(**{**base, **change}) is usable


def test_varlen_kernel_absent_in_old_torch_falls_back_to_the_loop(monkeypatch):
    from qvl.kernels import varlen_attention as module

    monkeypatch.setattr(module, "_varlen_kernel", lambda: None)
    assert not module.varlen_supported(device_type="cuda", dtype=torch.bfloat16, head_dim=128)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_thd_takes_one_varlen_call_where_usable(attention_factory, monkeypatch, causal):
    """The dispatch on CPU: with the kernel declared usable, a THD pack goes to ONE varlen call with the pack's
    cu_seqlens, max lengths, causality and softmax scale (the kernel itself is compared on a GPU in test_gpu)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels import varlen_attention as module

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, *, causal, scale):
        calls.append((cu_q.tolist(), cu_kv.tolist(), max_q, max_kv, causal, scale))
        bounds = cu_q.tolist()
        return torch.cat([naive_attention(q[a:b], k[a:b], v[a:b], causal) for a, b in zip(bounds, bounds[1:])])

    monkeypatch.setattr(module, "varlen_usable", lambda query, **kw: True)
    monkeypatch.setattr(module, "varlen_attention", fake_varlen)
    attention = attention_factory(causal)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = (torch.randn(15, h, 8) for h in (4, 2, 2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = attention(q, k, v, attention_mask=None, packed_seq_params=params)
    assert calls == [([0, 5, 6, 15], [0, 5, 6, 15], 9, 9, causal, attention.softmax_scale)]
    looped = attention._packed_loop(q, k, v, params, causal, 0.0)
    torch.testing.assert_close(out, looped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_hf_vision_tower_with_qvl_varlen_attention_equals_sdpa(family):
    """The provider's pre-wrap hook gives the replicated HF tower qvl's registered attention; on CPU (fp32) it loops
    over the tower's window / image blocks and equals transformers' SDPA path."""
    from transformers import AutoModel

    from qvl.bridges.providers import provider_from_hf
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.kernels.varlen_attention import HF_VARLEN_ATTENTION, varlen_vision_towers

    provider = provider_from_hf(tiny_hf_config(family))
    assert varlen_vision_towers in provider._pre_wrap_hooks
    torch.manual_seed(0)
    tower_class = type(AutoModel.from_config(tiny_hf_config(family)).visual)
    reference = tower_class._from_config(copy.deepcopy(provider.vision_config)).eval()  # as Megatron-Bridge builds it
    tower = copy.deepcopy(reference)
    (wrapper,) = varlen_vision_towers([torch.nn.ModuleDict({"visual": tower})])
    assert tower.config._attn_implementation == HF_VARLEN_ATTENTION != reference.config._attn_implementation
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])  # two images of several windows each
    vision = provider.vision_config
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size**2)
    with torch.no_grad():
        expected, got = reference(pixels, grid_thw=grid), wrapper["visual"](pixels, grid_thw=grid)
    expected, got = (getattr(o, "pooler_output", o) for o in (expected, got))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_megatron_vision_tower_keeps_its_own_attention():
    from qvl.bridges.providers import provider_from_hf
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.kernels.varlen_attention import varlen_vision_towers

    provider = provider_from_hf(tiny_hf_config("qwen3_vl"))
    assert varlen_vision_towers not in (getattr(provider, "_pre_wrap_hooks", None) or [])


def test_thd_hands_the_given_longest_length_to_the_kernel_unread(attention_factory, monkeypatch):
    """A longest length the caller gives goes to the varlen call as it is: a Python int (nothing to read back), or a
    0-d tensor that only the kernel call turns into an int; `given or computed` would read its truth value first."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels import varlen_attention as module
    from tests.kernels.test_speed_hf_vision import HostReads

    given = []
    # Megatron's RNG tracker compares its host-side states after each fork on CPU (a read that is not the attention's)
    monkeypatch.setattr(module.tensor_parallel, "get_cuda_rng_tracker", lambda: SimpleNamespace(fork=nullcontext))
    monkeypatch.setattr(module, "varlen_usable", lambda query, **kw: True)
    monkeypatch.setattr(module, "varlen_attention", lambda q, k, v, cu_q, cu_kv, max_q, max_kv, **kw: given.append(
        (max_q, max_kv)) or torch.zeros_like(q))  # fmt: skip
    attention = attention_factory(False)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = (torch.randn(15, h, 8) for h in (4, 2, 2))
    longest = torch.tensor(9)
    for max_seqlen in (9, longest):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                                 max_seqlen_kv=max_seqlen)  # fmt: skip
        with HostReads() as reads:
            attention(q, k, v, attention_mask=None, packed_seq_params=params)
        assert reads.reads == [] and given[-1][0] is max_seqlen and given[-1][1] is max_seqlen
