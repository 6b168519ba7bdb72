"""The language model's cross-entropy without an fp32 copy of the logits (patch group "speed-cross-entropy").

Megatron-Core 0.19.2's native fused cross-entropy (`cross_entropy_loss_fusion`, on in Megatron-Bridge's providers;
megatron/core/fusions/fused_cross_entropy.py) casts the logits to fp32, a second copy twice the size of the bf16
logits (2.4 GB for a 4k pack over Qwen's 151,936-token vocabulary), subtracts the max and exponentiates in place,
divides by the sum in place and keeps that fp32 softmax for backward, which returns the logits' gradient cast to bf16,
in fp32 training too (the parity check shows it). Its four compiled regions read and write the fp32 copy: about
17 GB of memory traffic per 4k pack.

`vocab_parallel_cross_entropy` computes the same quantities from the logits as they are: their max, then the
predicted logit and the sum of exponentials, in fp32 arithmetic inside each kernel. It keeps the logits (in bf16
half the memory of the fp32 softmax) and two fp32 values per token for backward, recomputes the softmax there and
returns the gradient in the logits' dtype. Three regions, each compiled where qvl's compiled regions run (CUDA with
Triton): about 4.7 GB per 4k pack. Run eagerly (CPU) its loss and gradient are bitwise those of Megatron-Core's unfused
`vocab_parallel_cross_entropy` (the same ops on the same values; tests/kernels/test_speed_cross_entropy.py). With tensor
parallelism it makes upstream's two all-reduces: the max, then the predicted logit and the sum together.
"""

from __future__ import annotations

import torch

from qvl.kernels import compiled

GROUP = "speed-cross-entropy"


def logits_max(logits: torch.Tensor) -> torch.Tensor:
    """The max over the vocabulary, in fp32."""
    return torch.max(logits.float(), dim=-1)[0]


def target_statistics(
    logits: torch.Tensor, target: torch.Tensor, max_: torch.Tensor, vocab_start: int, vocab_end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predicted shifted logit and sum of exponentials, concatenated; the mask of targets outside this rank's
    vocabulary; the targets as indices into it)."""
    shifted = logits.float() - max_.unsqueeze(-1)
    outside = (target < vocab_start) | (target >= vocab_end)
    local_target = (target - vocab_start).masked_fill(outside, 0)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    sum_exp = torch.exp(shifted).sum(dim=-1)
    return torch.cat((predicted, sum_exp)), outside, local_target


def logits_gradient(
    logits: torch.Tensor,
    max_: torch.Tensor,
    sum_exp: torch.Tensor,
    outside: torch.Tensor,
    local_target: torch.Tensor,
    grad_output: torch.Tensor,
) -> torch.Tensor:
    """(softmax - one-hot target) * dL/dloss, in the logits' dtype."""
    softmax = torch.exp(logits.float() - max_.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    is_target = vocab == local_target.unsqueeze(-1)
    update = (1.0 - outside.float()).unsqueeze(-1)
    grad = torch.where(is_target, softmax - update, softmax)
    return (grad * grad_output.unsqueeze(-1)).to(logits.dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
        from megatron.core.tensor_parallel.utils import VocabUtility

        parallel = tp_group is not None and tp_group.size() > 1
        max_ = compiled.region(logits_max, logits)(logits)
        if parallel:
            torch.distributed.all_reduce(max_, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        rank, size = (tp_group.rank(), tp_group.size()) if parallel else (0, 1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, size)
        statistics, outside, local_target = compiled.region(target_statistics, logits)(logits, target, max_, start, end)
        if parallel:
            torch.distributed.all_reduce(statistics, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        predicted, sum_exp = torch.split(statistics, statistics.shape[0] // 2)
        ctx.save_for_backward(logits, max_, sum_exp, outside, local_target)
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, max_, sum_exp, outside, local_target = ctx.saved_tensors
        grad = compiled.region(logits_gradient, logits)(logits, max_, sum_exp, outside, local_target, grad_output)
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token cross-entropy `[s, b]` of vocabulary-parallel logits `[s, b, v / tp]` (Megatron-Core's fused
    cross-entropy's signature and result)."""
    return _CrossEntropy.apply(logits, target, tp_group)


def lean_fused_cross_entropy(original):
    """Patch factory for the fused cross-entropy Megatron-Core's language models call."""
    return vocab_parallel_cross_entropy
