"""Multi-token prediction (MTP) in qvl's training step: each depth's loss computed beside the main loss, its targets
shifted inside every packed sub-sequence, token-weighted and logged as the main loss is.

Qwen3.5 / 3.6 / 3.8 checkpoints carry one MTP layer (qvl.bridges.mtp_reference). Megatron-Core runs it in the
model's forward, on the next token's input as vLLM serves it (vision features at image and video placeholders,
qvl.bridges.mtp_inputs); with patch group "fix-mtp-loss" applied around the forward (`states_kept`,
qvl.kernels.fix_mtp_loss) its states reach the output layer beside the main ones, and the step passes the model
`losses_with_mtp` as its output processor (Megatron-Core's `GPTModel._postprocess(output_processor=...)`), so the
model returns `LossesWithMtp` instead of the main losses alone. Then, per micro-batch:
- depth d's targets at position i are the labels at i + d of the same packed sub-sequence: the labels and the loss
  mask are shifted by one per depth inside each `cu_seqlens` piece, the last d positions of a piece masked, so no
  position learns a token of the next sample and a pack's MTP loss is the sum of its samples' (tests);
- the loss returned to Megatron's schedule is  sum(main) + (mtp_loss_scaling_factor / depths) * sum(MTP), divided
  later by the step's main-loss token count like every qvl loss (`calculate_per_token_loss`): each MTP token weighs
  the same in every micro-batch, data-parallel rank and pack;
- "mtp loss" is reported as (sum, tokens), reduced over micro-batches and ranks by Megatron-Bridge's loop like
  "lm loss", so the logged value is the token-weighted mean over the whole step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from qvl.foundation import patches
from qvl.kernels import fix_mtp_loss
from qvl.kernels.loss_rows import LossRows, losses_at_rows
from qvl.kernels.packed_shift import shift_in_sequences

MTP_LOSS = "mtp loss"  # the reporting key, beside Megatron-Bridge's "lm loss"


@dataclass(kw_only=True, slots=True, frozen=True)
class LossesWithMtp:
    """The model's output with MTP on: per-token losses [b, s] of the main head and of each MTP depth."""

    main: torch.Tensor
    mtp: tuple[torch.Tensor, ...]
    mtp_masks: tuple[torch.Tensor, ...]  # per depth, which positions have a target


def mtp_depths(config: Any) -> int:
    """How many MTP layers a model config trains (0: none)."""
    return int(getattr(config, "mtp_num_layers", None) or 0)


def model_arguments(config: Any, rows: LossRows | None = None) -> dict[str, Any]:
    """The forward arguments that make a model with MTP layers return `LossesWithMtp` (none without MTP); with
    `rows`, each head runs at its loss-bearing rows only (qvl.kernels.loss_rows)."""
    if not mtp_depths(config):
        return {}
    return {"output_processor": losses_with_mtp, **({"output_processor_context": rows} if rows is not None else {})}


def states_kept(config: Any) -> contextlib.AbstractContextManager:
    """Around a forward of a model with MTP layers: patch group "fix-mtp-loss", so the MTP states reach
    `losses_with_mtp` (qvl.kernels.fix_mtp_loss); nothing without MTP layers. Only the forward needs it."""
    return patches.applied(fix_mtp_loss.GROUP) if mtp_depths(config) else contextlib.nullcontext()


def losses_with_mtp(
    *,
    hidden_states: torch.Tensor,
    output_layer: Callable,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    packed_seq_params: Any,
    runtime_gather_output: bool | None,
    compute_language_model_loss: Callable,
    scale_logits: Callable,
    config: Any,
    context: LossRows | None = None,
    **_: Any,
) -> LossesWithMtp:
    """Output processor for `GPTModel._postprocess`: per-token losses of the main head and each MTP depth, from
    the states [(1 + depths) * s, b, h] that "fix-mtp-loss" leaves whole, through the shared output layer; with
    `context` (qvl.kernels.loss_rows), each at the rows where its mask is set only."""
    depths = mtp_depths(config)
    cu_seqlens = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
    targets, mask = labels, (loss_mask if loss_mask is not None else torch.ones_like(labels)).float()
    losses, masks = [], []
    for depth, states in enumerate(torch.chunk(hidden_states, 1 + depths, dim=0)):
        if depth:
            targets, mask = shift_in_sequences(targets, cu_seqlens), shift_in_sequences(mask, cu_seqlens)
        if context is not None:
            rows = (context.rows, *context.mtp_rows)[depth]
            losses.append(
                losses_at_rows(
                    states,
                    rows,
                    targets,
                    output_layer=output_layer,
                    output_weight=output_weight,
                    runtime_gather_output=runtime_gather_output,
                    compute_language_model_loss=compute_language_model_loss,
                    scale_logits=scale_logits,
                )
            )
        else:
            logits, _ = output_layer(states, weight=output_weight, runtime_gather_output=runtime_gather_output)
            losses.append(compute_language_model_loss(targets, scale_logits(logits)))
        masks.append(mask)
    return LossesWithMtp(main=losses[0], mtp=tuple(losses[1:]), mtp_masks=tuple(masks[1:]))


def loss_with_mtp(main_loss: Callable, scale: float, output: Any) -> tuple:
    """The step's loss function with MTP: `main_loss` (Megatron-Bridge's masked per-token loss) on the main head,
    plus `scale` x the MTP token losses' sum, and the MTP loss reported as (sum, tokens) under "mtp loss"."""
    if not isinstance(output, LossesWithMtp):
        return main_loss(output)
    loss, tokens, report = main_loss(output.main)
    mtp_sum = sum((losses.float() * mask).sum() for losses, mask in zip(output.mtp, output.mtp_masks, strict=True))
    mtp_tokens = sum(mask.sum() for mask in output.mtp_masks)
    report = {**report, MTP_LOSS: torch.stack([mtp_sum.detach(), mtp_tokens.float()])}
    return loss + scale * mtp_sum, tokens, report


def loss_function(main_loss: Callable, config: Any) -> Callable:
    """`main_loss`, or with MTP layers in `config` the loss that adds theirs (Megatron-Core's per-depth scale:
    mtp_loss_scaling_factor / depths)."""
    depths = mtp_depths(config)
    if not depths:
        return main_loss
    return partial(loss_with_mtp, main_loss, config.mtp_loss_scaling_factor / depths)
