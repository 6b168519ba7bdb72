"""The forward step of qvl's preference stages (`dpo`, `dpo_peft`): a micro-batch of packed pairs through the policy,
each side's log-prob summed per packed sub-sequence, scored against the reference by qvl.training.preference_loss.

A pack of a preference dataset holds whole pairs, chosen side first (qvl.data.preference); the loader's batch says
which sub-sequences form a pair (`pairs`) and, for a precomputed reference, each side's reference log-prob
(`reference_logps`, written by `qvl reference`). Per micro-batch:
- the model returns its per-token losses (the negated log-probs of the next tokens), as in SFT; a side's log-prob is
  the sum over its learned tokens, segment-summed on the device by an index the host built from `cu_seqlens`;
- the reference is the batch's precomputed log-probs (no model, no time), or for an adapter recipe with
  `reference=adapters` the same model under `torch.no_grad()` with its adapters switched off;
- the loss handed to Megatron's schedule is the sum of the pairs' losses and its count the micro-batch's pairs, so
  with `calculate_per_token_loss` (every qvl recipe) Megatron divides the step's gradient by the global batch's
  pairs: the loss is the mean over every pair of the step, however the pairs are packed (the same as TRL's with one
  pair per micro-batch);
- the MoE load-balancing loss is weighted as in SFT (qvl.kernels.fix_preference_moe_aux).
Every value of qvl.training.preference_loss.METRICS is reported as (sum, pairs) beside the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from qvl.data.count import IGNORE_INDEX
from qvl.foundation.errors import DataError
from qvl.kernels.speed_sync_free import LossCheck
from qvl.recipes.preference import ADAPTERS, PreferenceConfig
from qvl.training.preference_loss import METRICS, PairLogps, pair_losses
from qvl.training.step import (
    balanced_vision_inputs,
    host_batch,
    loss_rows_arguments,
    model_inputs,
    padded_length,
    to_device,
)

PREFERENCE_LOSS = "dpo loss"  # the reporting key of a preference stage's loss, where SFT reports "lm loss"


@dataclass(kw_only=True, slots=True, frozen=True)
class PairLayout:
    """Where a micro-batch's sides are, on the device: each token's sub-sequence (`subs` with the padding,
    qvl.training.step.padded_length), the sub-sequence indices of each pair's sides, each side's learned-token count,
    and its reference log-prob."""

    token_sub: torch.Tensor  # int64 [T]
    subs: int  # sub-sequences, the padding's included
    chosen: torch.Tensor  # int64 [pairs]
    rejected: torch.Tensor  # int64 [pairs]
    tokens: torch.Tensor  # float32 [subs] learned tokens per sub-sequence
    reference: torch.Tensor | None  # float32 [subs] precomputed reference log-prob per sub-sequence

    @property
    def pairs(self) -> int:
        return int(self.chosen.numel())


def pair_layout(batch: Any, device: torch.device, *, padded_to: int, precomputed: bool) -> PairLayout:
    """The PairLayout of a loader batch (built on the host from its `cu_seqlens_q`, `pairs` and reference columns)."""
    cu = batch.cu_seqlens_q.to(torch.int64)
    lengths = torch.diff(cu)
    padding = padded_to - int(cu[-1])
    subs = len(lengths) + (padding > 0)
    token_sub = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if padding > 0:
        token_sub = torch.cat([token_sub, torch.full((padding,), len(lengths))])
    learned = ((batch.loss_mask[0] > 0) & (batch.labels[0] != IGNORE_INDEX)).to(torch.float32)
    tokens = torch.zeros(subs).index_add_(0, token_sub[: learned.numel()], learned)
    pairs = getattr(batch, "pairs", None)
    if pairs is None or not len(pairs):
        raise DataError(
            f"a preference step got a micro-batch without pairs (packs {getattr(batch, '__key__', '?')}); train a "
            "preference recipe on a dataset of pairs (`qvl data prepare --kind preference ...`)"
        )
    reference = None
    if precomputed:
        reference = batch.reference_logps.to(torch.float32)
        counted = batch.reference_tokens.to(torch.float32)
        if not torch.equal(counted, tokens[: len(counted)]):
            raise DataError(
                f"the reference log-probs of packs {getattr(batch, '__key__', '?')} were summed over "
                f"{counted.tolist()} learned tokens per side, this dataset learns {tokens[: len(counted)].tolist()}; "
                "compute the reference again on this dataset with `qvl reference RECIPE ...`"
            )
        reference = torch.cat([reference, reference.new_zeros(subs - len(reference))])
    return PairLayout(
        token_sub=to_device(token_sub, device),
        subs=subs,
        chosen=to_device(pairs[:, 0].to(torch.int64), device),
        rejected=to_device(pairs[:, 1].to(torch.int64), device),
        tokens=to_device(tokens, device),
        reference=None if reference is None else to_device(reference, device),
    )


def side_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor, layout: PairLayout) -> torch.Tensor:
    """Each sub-sequence's summed log-prob of its learned tokens [subs], from the model's per-token losses [b, T]."""
    logps = -(token_losses.view(-1).float() * loss_mask.view(-1).float())
    return logps.new_zeros(layout.subs).index_add(0, layout.token_sub, logps)


def pair_logps(layout: PairLayout, logps: torch.Tensor, reference: torch.Tensor | None = None) -> PairLogps:
    """Each pair's sides from per-sub-sequence log-probs [subs]; the reference's from `reference` (adapters off) or
    the batch's precomputed column (None for SimPO)."""
    reference = layout.reference if reference is None else reference
    return PairLogps(
        chosen=logps[layout.chosen],
        rejected=logps[layout.rejected],
        chosen_tokens=layout.tokens[layout.chosen],
        rejected_tokens=layout.tokens[layout.rejected],
        ref_chosen=None if reference is None else reference[layout.chosen],
        ref_rejected=None if reference is None else reference[layout.rejected],
    )


def preference_loss(
    layout: PairLayout,
    loss_mask: torch.Tensor,
    config: PreferenceConfig,
    reference: torch.Tensor | None,
    output_tensor: torch.Tensor,
    *,
    loss_check: LossCheck | None = None,
) -> tuple:
    """The loss function handed to Megatron's schedule: (sum of the pairs' losses, pairs, reports as (sum, pairs))."""
    if isinstance(output_tensor, tuple):  # some VLM paths return (losses, loss_mask) under context parallelism
        output_tensor, loss_mask = output_tensor
    per_pair = pair_logps(layout, side_logps(output_tensor, loss_mask, layout), reference)
    losses, metrics = pair_losses(per_pair, config)
    loss = losses.sum()
    if loss_check is not None:
        loss_check.keep(loss)
    pairs = torch.tensor(layout.pairs, dtype=torch.int, device=loss.device)
    count = pairs.float().view(1)
    report = {PREFERENCE_LOSS: torch.cat([loss.detach().view(1), count])}
    for name in METRICS:
        report[name] = torch.cat([metrics[name].sum().float().view(1), count])
    return loss, pairs, report


def preference_forward_step(
    state: Any,
    data_iterator: Iterator,
    model: Any,
    return_schedule_plan: bool = False,
    *,
    loss_check: LossCheck | None = None,
):
    """Megatron-Bridge forward step of a preference stage: the next micro-batch of pairs through the policy, and the
    loss function scoring its pairs (`state.cfg.qvl.preference`)."""
    from qvl.kernels import fix_preference_moe_aux

    device = next(model.parameters()).device
    cfg = state.cfg
    settings: PreferenceConfig = cfg.qvl.preference
    batch = next(data_iterator)
    kwargs, loss_mask = model_inputs(batch, device, pad_to=padded_length(cfg.model, batch.tokens.shape[1]))
    layout = pair_layout(
        batch, device, padded_to=kwargs["input_ids"].shape[1], precomputed=settings.reference == "precomputed"
    )
    if cfg.qvl.vision_balance:
        kwargs = balanced_vision_inputs(model, kwargs)
    reference = None
    if settings.reference == ADAPTERS:
        reference = adapters_off_logps(cfg, model, batch, kwargs, loss_mask, layout, device)
    rows = loss_rows_arguments(cfg, batch, device)  # the output layer at the learned tokens only
    with fix_preference_moe_aux.weighted_per_pair(model, pairs=layout.pairs):
        output = model(**kwargs, **rows, host_batch=host_batch(model, batch, kwargs, device))
    # NaN and Inf are checked once after the step through `loss_check` (qvl.kernels.speed_sync_free)
    return output, partial(preference_loss, layout, loss_mask, settings, reference, loss_check=loss_check)


def adapters_off_logps(
    cfg: Any, model: Any, batch: Any, kwargs: dict, loss_mask: torch.Tensor, layout: PairLayout, device
) -> torch.Tensor:
    """The reference's summed log-prob per sub-sequence: the same model with its adapters (`cfg.peft`) switched off,
    no gradient (one pipeline stage holds the whole model: the recipe refuses reference=adapters with pipeline
    parallelism)."""
    from megatron.core.utils import unwrap_model

    peft = cfg.peft
    context = peft.disable_adapter(unwrap_model(model)) if peft is not None else contextlib.nullcontext()
    with torch.no_grad(), context:
        rows = loss_rows_arguments(cfg, batch, device)
        output = model(**kwargs, **rows, host_batch=host_batch(model, batch, kwargs, device))
    if isinstance(output, tuple):
        output, loss_mask = output
    return side_logps(output, loss_mask, layout).detach()
