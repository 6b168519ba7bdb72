"""The output layer and the loss on the positions whose loss counts, and nowhere else (qvl's forward step; the
training setting `qvl.loss_rows_only`, on by default).

A pack's loss counts at its answer tokens (SFT) or its text tokens (pretraining): not at image and video placeholders,
not at an SFT prompt, not at the pad that pipeline and sequence parallelism add. Megatron-Core 0.19.2's
`GPTModel._postprocess` runs the output layer and the cross-entropy at every position, and the loss function then
multiplies the per-token losses by the loss mask. The output layer is a [tokens, hidden] x [hidden, vocab] GEMM three
times per micro-batch (forward, input gradient, weight gradient) over Qwen's 151,936-token vocabulary, and the
cross-entropy reads the [tokens, vocab] logits three times: at the census pack (benchmarks/RESULTS.md: five
LLaVA-like samples of one 1,936-patch image each per 4k pack) most of that is spent on image placeholders.

Here the step finds the loss-bearing positions on the host, from the loader's loss mask and labels (no host read of
the device), sends their indices with the batch (`LossRows`), and hands the language model Megatron-Core's own hook
for this, `output_processor` (`GPTModel._postprocess`): `loss_rows_output` runs the output layer and the loss on the
hidden states at those positions and returns the per-token losses [b, s], zero at every other position. The loss
function's masked sum, the gradients and the token count are those of the whole-pack path; only the rounding of the
output layer's weight gradient (a sum over fewer rows, the masked ones having added zeros) may differ in the last bit.

Under sequence parallelism the hidden states are gathered first (the gather the output layer would make), with a
backward that keeps each rank's own slice, and the output layer runs as a tensor-parallel layer on the whole
selection (its input gradient all-reduced over the TP group). With MTP layers their output processor
(qvl.training.mtp.losses_with_mtp) takes the same context: each depth runs at the rows where its own mask (the main
one moved `depth` positions left inside each sample) is set. Not taken (the whole-pack path): under context
parallelism (each rank holds a slice of the pack), for more than one pack per micro-batch, and where a model's forward
does not pass the hook on (Megatron-Bridge's own Qwen2/2.5-VL forward, which qvl's runs only for a micro-batch without
its host batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qvl.kernels.packed_shift import shift_in_sequences


@dataclass(kw_only=True, slots=True, frozen=True)
class LossRows:
    """The positions of a pack [1, s] whose loss counts, as int64 indices on the model's device: the main head's, and
    each MTP depth's (where its targets, the labels `depth` tokens ahead in the same sample, are learned)."""

    rows: torch.Tensor
    mtp_rows: tuple[torch.Tensor, ...] = ()


def host_loss_rows(
    loss_mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None = None,
    mtp_depths: int = 0,
) -> list[torch.Tensor] | None:
    """The loss-bearing positions of a micro-batch of one pack, on the host: where `loss_mask` [1, s] is set and
    `labels` [1, s] is not `ignore_index` (what the step's loss mask keeps), then for each of `mtp_depths` MTP depths
    where that mask moved one more position left inside each sample of `cu_seqlens` is set (the depth's own mask,
    qvl.training.mtp). A mask with no position set gives the pack's first position, whose loss the mask drops: the
    output layer and the loss still run, on one row, and backward reaches every parameter with zeros, as on the whole
    pack. None for more than one pack."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != 1:
        return None
    keep = ((loss_mask > 0) & (labels != ignore_index)).cpu().to(torch.int8)
    found = []
    for depth in range(1 + mtp_depths):
        if depth:
            keep = shift_in_sequences(keep, None if cu_seqlens is None else cu_seqlens.cpu())
        rows = torch.nonzero(keep[0], as_tuple=False).reshape(-1)
        found.append(rows if rows.numel() else torch.zeros(1, dtype=torch.long))
    return found


def losses_at_rows(
    hidden_states: torch.Tensor,
    rows: torch.Tensor,
    labels: torch.Tensor,
    *,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    runtime_gather_output: bool | None,
    compute_language_model_loss: Callable,
    scale_logits: Callable,
) -> torch.Tensor:
    """The per-token losses [b, s] of `labels` with the output layer and the loss run at `rows` of `hidden_states`
    [s, b, h] (this rank's share of them under sequence parallelism) only, zero elsewhere."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    sequence_parallel = output_layer.sequence_parallel
    if sequence_parallel:  # the whole pack on every TP rank; backward keeps this rank's slice of the gradient
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=output_layer.tp_group
        )
    picked = hidden_states.index_select(0, rows)  # [n, b, h]
    output_layer.sequence_parallel = False  # its input is now whole: a plain tensor-parallel layer (dgrad all-reduced)
    try:
        logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
    finally:
        output_layer.sequence_parallel = sequence_parallel
    losses = compute_language_model_loss(labels.index_select(1, rows), scale_logits(logits))  # [b, n]
    return losses.new_zeros(labels.shape).index_copy(1, rows, losses)


def loss_rows_output(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    runtime_gather_output: bool | None,
    context: LossRows,
    compute_language_model_loss: Callable,
    scale_logits: Callable,
    **_: Any,
) -> torch.Tensor:
    """Output processor for `GPTModel._postprocess`: the per-token losses [b, s] with the output layer and the loss
    run at `context.rows` only, zero elsewhere."""
    return losses_at_rows(
        hidden_states,
        context.rows,
        labels,
        output_layer=output_layer,
        output_weight=output_weight,
        runtime_gather_output=runtime_gather_output,
        compute_language_model_loss=compute_language_model_loss,
        scale_logits=scale_logits,
    )
