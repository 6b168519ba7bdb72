"""Patch group "fix-qwen3-vl-deepstack-sp": each rank keeps upstream's rows of the deepstack features, and their
gradient comes back in place to be summed over the TP group (one process here: the sum is the rank's own; at TP=2
tests/training/test_parity_parallel.py compares the mergers' gradients with transformers')."""

from __future__ import annotations

import torch

from qvl.foundation import distributed
from qvl.kernels.fix_qwen3_vl_deepstack_sp import summed_over_ranks


def test_each_rank_keeps_upstreams_rows_and_their_gradient_returns_in_place(cpu_runtime):
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()  # with its stand-ins for what is not installed (Transformer Engine)
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import split_deepstack_embs

    # a pack of 8 tokens, visual at 1, 2, 5 and 6: under TP=2 rank 1 holds tokens 4-7, i.e. visual rows 2 and 3
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    features = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    distributed.init_distributed()
    try:
        masks, rows = summed_over_ranks(split_deepstack_embs)(mask, features, tp_size=2, tp_rank=1,
                                                              sequence_parallel=True)  # fmt: skip
        expected_masks, expected = split_deepstack_embs(mask, features, tp_size=2, tp_rank=1, sequence_parallel=True)
        assert torch.equal(masks, expected_masks)
        for got, want in zip(rows, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        sum(r.sum() * (i + 1) for i, r in enumerate(rows)).backward()
        for i, feature in enumerate(features):
            assert feature.grad[:2].abs().sum() == 0 and torch.all(feature.grad[2:] == i + 1)
    finally:
        distributed.destroy_distributed()


def test_without_sequence_parallelism_upstreams_split_is_used():
    calls = []

    def original(masks, embeds, **kwargs):
        calls.append(kwargs)
        return masks, embeds

    mask, embeds = torch.ones(1, 4, dtype=torch.bool), [torch.zeros(4, 2)]
    assert summed_over_ranks(original)(mask, embeds, tp_size=2, tp_rank=0, sequence_parallel=False) == (mask, embeds)
    assert calls == [dict(tp_size=2, tp_rank=0, cp_size=1, cp_rank=0, sequence_parallel=False)]
