"""qvl's fused cross-entropy (qvl.kernels.speed_cross_entropy): bitwise Megatron-Core's unfused vocab-parallel
cross-entropy when run eagerly, on one rank and split over two, keeping the logits (not an fp32 softmax) for
backward; on CUDA its compiled regions within rounding of the eager math."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import megatron
from qvl.foundation.distributed import start_ranks

VOCAB = 96
TOKENS, BATCH = 11, 2


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(TOKENS, BATCH, VOCAB, generator=generator) * 4).to(dtype)
    target = torch.randint(0, VOCAB, (TOKENS, BATCH), generator=generator)
    return logits, target


def _loss_and_grad(function, logits: torch.Tensor, target: torch.Tensor, **kwargs):
    logits = logits.detach().clone().requires_grad_()
    loss = function(logits, target, **kwargs)
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view_as(
        loss
    )  # a loss mask's role: unequal output grads
    (loss * weights).sum().backward()
    return loss.detach(), logits.grad


def _upstream(logits, target, tp_group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, target, tp_group=tp_group)


def _lean(logits, target, tp_group):
    from qvl.kernels.speed_cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, target, tp_group)


@pytest.fixture
def one_rank_group(free_port):
    megatron.import_megatron_bridge()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1)
    yield torch.distributed.new_group([0])
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_megatrons_unfused_cross_entropy_bitwise(one_rank_group, dtype):
    logits, target = _inputs(dtype)
    loss, grad = _loss_and_grad(_lean, logits, target, tp_group=one_rank_group)
    expected_loss, expected_grad = _loss_and_grad(_upstream, logits, target, tp_group=one_rank_group)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, expected_loss)
    assert torch.equal(grad, expected_grad)
    # and it is the cross-entropy
    reference = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), reference, rtol=1e-5, atol=1e-5)


def test_keeps_the_logits_for_backward_not_an_fp32_softmax(one_rank_group):
    logits, target = _inputs(torch.bfloat16)
    logits.requires_grad_()

    def largest_saved(function) -> torch.Tensor:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            function(logits, target, tp_group=one_rank_group)
        return max(saved, key=lambda t: t.numel() * t.element_size())

    kept = largest_saved(_lean)
    assert kept.dtype == torch.bfloat16 and kept.shape == logits.shape
    upstream_kept = largest_saved(_upstream)
    assert upstream_kept.dtype == torch.float32 and upstream_kept.shape == logits.shape  # the fp32 softmax


def test_targets_outside_the_vocabulary_shard_contribute_nothing(one_rank_group):
    from qvl.kernels.speed_cross_entropy import logits_gradient, logits_max, target_statistics

    logits, target = _inputs(torch.float32, seed=1)
    max_ = logits_max(logits)
    statistics, outside, local_target = target_statistics(logits, target, max_, 0, VOCAB // 2)
    predicted, sum_exp = statistics.chunk(2)
    assert torch.equal(outside, target >= VOCAB // 2)
    assert torch.all(predicted[outside] == 0) and torch.all(local_target[outside] == 0)
    grad = logits_gradient(logits, max_, sum_exp, outside, local_target, torch.ones(TOKENS, BATCH))
    softmax = torch.exp(logits - max_.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    assert torch.equal(grad[outside], softmax[outside])  # no one-hot subtracted where the target is elsewhere


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    megatron.import_megatron_bridge()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = torch.distributed.new_group([0, 1])
        logits, target = _inputs(torch.float32)
        shard = logits.chunk(2, dim=-1)[rank]
        lean = _loss_and_grad(_lean, shard, target, tp_group=group)
        upstream = _loss_and_grad(_upstream, shard, target, tp_group=group)
        torch.save({"lean": lean, "upstream": upstream}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_equal_upstream_bitwise_and_the_whole_vocabulary(tmp_path, free_port):
    start_ranks(_two_rank_worker, (free_port, str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for result in ranks:
        assert torch.equal(result["lean"][0], result["upstream"][0])
        assert torch.equal(result["lean"][1], result["upstream"][1])
    logits, target = _inputs(torch.float32)
    whole = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    torch.testing.assert_close(ranks[0]["lean"][0].flatten(), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(ranks[0]["lean"][0], ranks[1]["lean"][0])  # every rank has the whole loss
    grads = torch.cat([ranks[0]["lean"][1], ranks[1]["lean"][1]], dim=-1)
    _, whole_grad = _loss_and_grad(
        lambda x, t: torch.nn.functional.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="none").view_as(t),
        logits,
        target,
    )
    torch.testing.assert_close(grads, whole_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_compiled_regions_on_cuda_bf16_match_the_eager_math():
    """On CUDA with Triton each region is compiled (fp32 arithmetic in one kernel): loss within fp32 rounding of the
    eager path, gradient within bf16 rounding; the group of one rank needs no process group."""
    from qvl.kernels import compiled

    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    megatron.import_megatron_bridge()

    class _OneRank:
        def size(self) -> int:
            return 1

        def rank(self) -> int:
            return 0

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2048, 1, 151_936, generator=generator) * 3).to(torch.bfloat16).cuda()
    target = torch.randint(0, 151_936, (2048, 1), generator=generator).cuda()
    loss, grad = _loss_and_grad(_lean, logits, target, tp_group=_OneRank())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "runs_compiled", lambda tensor: False)
        eager_loss, eager_grad = _loss_and_grad(_lean, logits, target, tp_group=_OneRank())
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=1.6e-2, atol=1e-6)
