"""Qwen3-VL's deepstack features split over the sequence-parallel ranks with the gradient each rank's share needs
(patch group "fix-qwen3-vl-deepstack-sp" of qvl.foundation.patches).

Qwen3-VL adds three of its vision tower's intermediate features (the "deepstack" features, one row per visual
token) to the hidden states of the first language-model layers. Under sequence parallelism each tensor-parallel rank
holds a share of the sequence, so Megatron-Bridge 0.6.2 keeps, on each rank, the rows of its own visual tokens
(`split_deepstack_embs`, modelling_qwen3_vl/utils.py) by slicing the features, which every rank holds whole: the
tower and its deepstack mergers are tensor-parallel, their outputs the same on every rank. A slice's gradient is zero
outside the rank's rows, and the mergers' backward assumes the gradient of their output is the same on every rank
(the row-parallel layer's all-reduce has an identity backward), so each rank computed its merger and tower weight
gradients from its own visual tokens only: at TP=2 the mergers' first weight gradient was 77% off in the parity check
(tests/training/test_parity_parallel.py).

Here the rows are taken as upstream takes them (its own function, given each row's index to pick), with a backward
that adds the ranks' gradients over the tensor-parallel group, as Megatron-Core's `scatter_to_sequence_parallel_region`
does for the token embeddings: every rank then holds the gradient of the whole features. Context parallelism's
split (upstream's other use of the function, for unpacked batches) is left as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

GROUP = "fix-qwen3-vl-deepstack-sp"


class _RankRows(torch.autograd.Function):
    """`features[rows]` forward; backward, the rows' gradient put back in place and summed over `group`."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, rows: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.shape, ctx.group = features.shape, group
        return features.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        whole = grad.new_zeros(ctx.shape).index_add_(0, rows, grad)
        torch.distributed.all_reduce(whole, group=ctx.group)
        return whole, None, None


def summed_over_ranks(original: Callable) -> Callable:
    """Replacement factory for `split_deepstack_embs` as modelling_qwen3_vl/model.py imports it: upstream's split,
    its rows picked with a backward that sums the tensor-parallel ranks' gradients where sequence parallelism splits
    the features over them."""

    @functools.wraps(original)
    def split_deepstack_embs(visual_pos_masks, deepstack_visual_embeds, tp_size=1, tp_rank=0, cp_size=1, cp_rank=0,
                             sequence_parallel=False):  # fmt: skip
        split = functools.partial(original, tp_size=tp_size, tp_rank=tp_rank, cp_size=cp_size, cp_rank=cp_rank,
                                  sequence_parallel=sequence_parallel)  # fmt: skip
        split_over_tp = sequence_parallel and tp_size > 1 and cp_size == 1
        if not split_over_tp or visual_pos_masks is None or not deepstack_visual_embeds:
            return split(visual_pos_masks, deepstack_visual_embeds)
        features = deepstack_visual_embeds[0]
        index = torch.arange(features.shape[0], device=features.device)
        masks, (rows,) = split(visual_pos_masks, [index])
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        return masks, [_RankRows.apply(embeds, rows, group) for embeds in deepstack_visual_embeds]

    return split_deepstack_embs
