"""Patch group "fix-moe-pad-tokens": a pack padded for pipeline parallelism gives the MoE router the load-balancing
loss of the same pack unpadded (tiny Qwen3-VL-MoE and Qwen3.5-VL-MoE, fp32 on the CPU); without the group the pad
tokens are counted. The mask each rank builds for its share of the tokens under sequence parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qvl.foundation import distributed, patches
from qvl.kernels.fix_moe_pad_tokens import GROUP, PaddedPack, pad_mask
from tests.tiny_megatron import tiny_megatron_model


def _layer(*, tp_rank: int = 0, sequence_parallel: bool = False, cp: int = 1):
    config = SimpleNamespace(sequence_parallel=sequence_parallel, context_parallel_size=cp)
    return SimpleNamespace(config=config, pg_collection=SimpleNamespace(tp=SimpleNamespace(rank=lambda: tp_rank)))


def test_each_rank_masks_the_pad_among_its_own_tokens():
    pack = PaddedPack(qkv_format="thd", pad_from=10)
    hidden = torch.zeros(8, 1, 4)
    # sequence parallelism: rank 1 holds tokens 8-15 of 16, the pad from token 10 on
    assert pad_mask(_layer(tp_rank=1, sequence_parallel=True), hidden, pack).tolist() == [[False] * 2 + [True] * 6]
    assert pad_mask(_layer(tp_rank=0, sequence_parallel=True), hidden, pack).tolist() == [[False] * 8]
    # without it every rank holds the whole pack
    assert pad_mask(_layer(tp_rank=1), torch.zeros(16, 1, 4), pack).tolist() == [[False] * 10 + [True] * 6]


def test_an_unmarked_pack_or_context_parallelism_keeps_upstreams_routing():
    from megatron.core.packed_seq_params import PackedSeqParams

    hidden = torch.zeros(8, 1, 4)
    assert pad_mask(_layer(), hidden, PackedSeqParams(qkv_format="thd")) is None
    assert pad_mask(_layer(), hidden, None) is None
    assert pad_mask(_layer(cp=2), hidden, PaddedPack(qkv_format="thd", pad_from=4)) is None


def _text_pack(lengths: list[int], first: int, vocab: int) -> SimpleNamespace:
    """A loader-like packed batch of text sub-sequences of ids in [first, vocab) (mRoPE positions count from 0 in
    each)."""
    total = sum(lengths)
    tokens = torch.randint(first, vocab, (1, total), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(3, 1, total)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        tokens=tokens,
        labels=tokens.roll(-1, dims=1),
        loss_mask=torch.ones(1, total),
        position_ids=positions,
        cu_seqlens_q=cu,
        max_seqlen=max(lengths),
    )


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_vl_moe"])
def test_a_padded_pack_balances_experts_as_the_pack_alone(family, cpu_runtime, monkeypatch):
    from megatron.core.transformer.moe.router import TopKRouter

    from qvl.training.step import model_inputs

    seen = []
    original = TopKRouter.attach_and_log_load_balancing_loss

    def recording(self, activation, coeff, aux_loss, name, group, *args, **kwargs):
        seen.append((name, aux_loss.detach().clone(), float(kwargs["valid_token_count"])))
        return original(self, activation, coeff, aux_loss, name, group, *args, **kwargs)

    monkeypatch.setattr(TopKRouter, "attach_and_log_load_balancing_loss", recording)
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model(family, gradient_accumulation_fusion=False)
        model.train()
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        special = (hf_config.image_token_id, hf_config.video_token_id, hf_config.vision_start_token_id)
        batch = _text_pack([23, 17, 30], max(special) + 1, hf_config.text_config.vocab_size)

        def forward(pad_to: int | None):
            seen.clear()
            for router in routers:  # the global balancing loss averages over a step's micro-batches: one here
                for name in ("global_tokens_per_expert", "ga_steps"):
                    if getattr(router, name, None) is not None:
                        getattr(router, name).zero_()
            kwargs, _ = model_inputs(batch, torch.device("cpu"), pad_to=pad_to)
            logits = model(**{k: v for k, v in kwargs.items() if k not in ("labels", "loss_mask")})
            logits = logits[0] if isinstance(logits, tuple) else logits
            return logits.detach()[..., :70, :], list(seen)

        alone, losses = forward(None)
        assert losses and all(count == 70 for _, _, count in losses), "every router counts the pack's 70 tokens"
        with patches.applied(GROUP):
            padded, masked = forward(96)
        torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)  # the pad changes no real token's output
        assert [(name, count) for name, _, count in masked] == [(name, count) for name, _, count in losses]
        for (_, loss, _), (_, unpadded, _) in zip(masked, losses):
            torch.testing.assert_close(loss, unpadded, rtol=1e-5, atol=1e-7)
        _, counted = forward(96)  # upstream: the 26 pad tokens are counted
        assert all(count == 96 for _, _, count in counted)
        assert any(not torch.allclose(loss, unpadded) for (_, loss, _), (_, unpadded, _) in zip(counted, losses))
    finally:
        distributed.destroy_distributed()


def counted_on_rank(lengths: list[int]) -> tuple[float, float, int]:
    """On each of two gloo ranks (a tensor-parallel group): upstream's masked token count for this rank's share of
    `lengths` (rank 0's and rank 1's unmasked tokens of 8), the count the group's router scales its balancing loss by
    (`weighed_evenly`), and what it makes of a count given as a number (no mask)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

    from qvl.kernels.fix_moe_pad_tokens import weighed_evenly

    group = parallel_state.get_tensor_model_parallel_group()
    routing_map = torch.zeros(8, 4, dtype=torch.bool)
    unmasked = lengths[torch.distributed.get_rank()]
    routing_map[:unmasked, 0] = routing_map[:unmasked, 1] = True  # top-2 of 4 experts; the rest masked out
    _, local, total = get_tokens_per_expert_and_token_count(routing_map, group, topk=2, with_padding_mask=True)
    assert float(total) == sum(lengths)
    seen = []
    attach = weighed_evenly(lambda self, *args, valid_token_count: seen.append(valid_token_count))
    router = SimpleNamespace(tp_cp_group=group)
    attach(router, None, 1e-3, None, "load_balancing_loss", group, valid_token_count=local)
    attach(router, None, 1e-3, None, "load_balancing_loss", group, valid_token_count=8)
    return float(local), float(seen[0]), seen[1]


def test_a_masked_routers_count_is_its_groups_mean_not_its_total():
    """Megatron-Core 0.19.2's masked count is the reduce group's total (its all-reduce writes into the local counts it
    sums): with 6 and 2 of 8 tokens unmasked on two tensor-parallel ranks, each counts 8, so a masked pack's balancing
    loss weighed twice an unmasked one's (whose count is the rank's 8 rows). The group makes it the mean, 4; a count
    given as a number stays. If upstream stops counting the group's total, the first assertion fails and the division
    must go."""
    ranks = distributed.run_on_ranks(counted_on_rank, [6, 2], tensor_parallel=2, cpu=True)
    assert [upstream for upstream, _, _ in ranks] == [8.0, 8.0]
    assert [weighed for _, weighed, _ in ranks] == [4.0, 4.0]
    assert [number for _, _, number in ranks] == [8, 8]
