"""The pairs of a preference parity run, as TRL's trainers take them: cut back out of the packs qvl's loop consumed.

Each recorded micro-batch (a PreferenceBatch: packed sub-sequences, `pairs` as (chosen, rejected) sub-sequence
indices) is unpacked into its sides (qvl.training.parity.transformers_run.unpack: token ids, pixels and grids of
each), and every pair becomes one TRL micro-batch. Which tokens a side learns is read from its token ids alone, as
TRL defines a completion, independently of qvl's loss mask: what follows the last `<|im_start|>assistant\\n` header,
up to and including its `<|im_end|>` (the answer; Qwen3.5's empty `<think>` block included, as its chat template
writes it). TRL's own collator would learn the newline after `<|im_end|>` too, which qvl's packs do not: the check
feeds TRL qvl's completion (docs/parity.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qvl.foundation.errors import DataError
from qvl.training.parity.megatron_run import Recording
from qvl.training.parity.moe_aux import PackSlot
from qvl.training.parity.transformers_run import IGNORE, unpack

SIDES = ("chosen", "rejected")
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(kw_only=True, slots=True)
class PairInputs:
    """One pair of an optimizer step: each side's inputs (batch size 1), where it sat in qvl's run, and its pack."""

    chosen: dict
    rejected: dict
    place: tuple[int, int, int]  # (micro-batch of the step, chosen sub-sequence, rejected sub-sequence)
    slot: PackSlot  # the pack's index in the step and its tokens (the MoE load-balancing loss)
    pack_pairs: int  # the pairs of its pack


@dataclass(kw_only=True, slots=True)
class PairRecord:
    """One pair at one step, as a framework scored it (the policy at the step's starting weights): each side's
    log-prob summed over its learned tokens, under the policy and the reference, and the pair's loss."""

    step: int
    loss: float
    logp_chosen: float
    logp_rejected: float
    ref_logp_chosen: float | None  # None without a reference (SimPO)
    ref_logp_rejected: float | None
    reward_margin: float | None = None  # where the framework's record has it per pair (qvl's)


# A step's rewards as both frameworks report them: the mean over the step's pairs (TRL's rewards/* metrics)
REWARDS = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")


@dataclass(kw_only=True, slots=True)
class Scores:
    """What a framework scored over the steps: every pair (step, then the loop's order), and each step's rewards as
    it reported them (REWARDS -> the mean over the step's pairs)."""

    pairs: list[PairRecord]
    rewards: list[dict[str, float]]


def completion_mask(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """1 on a side's completion (the last assistant turn's content and its `<|im_end|>`), 0 elsewhere."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    ids_list = ids.tolist()
    heads = [
        i for i, t in enumerate(ids_list) if t == start and ids_list[i + 1 : i + 1 + len(header)] == header
    ]  # fmt: skip
    if not heads:
        raise DataError(f"a preference side has no assistant turn ({len(ids_list)} tokens); re-prepare the pairs")
    first = heads[-1] + 1 + len(header)
    last = ids_list.index(end, first) if end in ids_list[first:] else len(ids_list) - 1
    mask = torch.zeros_like(ids)
    mask[first : last + 1] = 1
    return mask


def pairs_per_step(recording: Recording, hf_config, tokenizer, *, seconds_per_grid: bool) -> list[list[PairInputs]]:
    """For each optimizer step of qvl's run, its pairs in the order the loop consumed them (micro-batch, then the
    batch's `pairs` rows), each side with its completion mask."""
    steps: dict[int, list[PairInputs]] = {}
    micro_batch: dict[int, int] = {}
    for record in recording.micro_batches:
        index = micro_batch[record.step] = micro_batch.get(record.step, -1) + 1
        sides = unpack(record.batch, hf_config, tokenizer, seconds_per_grid=seconds_per_grid)
        for side in sides:
            side["completion_mask"] = completion_mask(side["input_ids"][0], tokenizer)[None]
        slot = PackSlot(pack=index, tokens=int(record.batch.tokens.shape[1]))
        pairs = record.batch.pairs.tolist()
        steps.setdefault(record.step, []).extend(
            PairInputs(chosen=sides[c], rejected=sides[r], place=(index, c, r), slot=slot, pack_pairs=len(pairs))
            for c, r in pairs
        )
    return [steps[s] for s in sorted(steps)]


def _padded(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    width = max(int(r.shape[-1]) for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - int(r.shape[-1])), value=value) for r in rows])


def _vision(pair: PairInputs) -> dict:
    """Both sides' pixels and grids, chosen first (the order of their placeholders in TRL's [chosen, rejected])."""
    out = {}
    for key in VISION_KEYS:
        parts = [side[key] for side in (pair.chosen, pair.rejected) if key in side]
        if parts:
            out[key] = torch.cat(parts)
    return out


def dpo_batch(pair: PairInputs, pad_token_id: int) -> dict:
    """TRL DPOTrainer's batch of one pair: rows [chosen, rejected], right-padded, with `completion_mask`."""
    sides = (pair.chosen, pair.rejected)
    return {
        "input_ids": _padded([s["input_ids"] for s in sides], pad_token_id),
        "attention_mask": _padded([s["attention_mask"] for s in sides], 0),
        "completion_mask": _padded([s["completion_mask"] for s in sides], 0),
        "mm_token_type_ids": _padded([s["mm_token_type_ids"] for s in sides], 0),
        **_vision(pair),
    }


def cpo_batch(pair: PairInputs) -> dict:
    """TRL CPOTrainer's batch of one pair: `chosen_*` / `rejected_*` ids, masks and labels (the completion learned),
    and both sides' pixels, which its text-only forward does not pass (qvl.training.parity.preference_trl)."""
    batch = _vision(pair)
    for name, side in zip(SIDES, (pair.chosen, pair.rejected), strict=True):
        ids = side["input_ids"]
        batch[f"{name}_input_ids"] = ids
        batch[f"{name}_attention_mask"] = side["attention_mask"]
        batch[f"{name}_labels"] = ids.masked_fill(side["completion_mask"] == 0, IGNORE)
    return batch


def side_token_losses(logps: torch.Tensor, completion: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A side's per-position loss and learned flag as qvl records them (position i predicts token i + 1; the last
    predicts nothing), from TRL's shifted per-token log-probs [>= length - 1] and the side's completion mask [length]."""
    mask = completion[1:length].bool()
    losses = -logps[: length - 1].detach().float().cpu() * mask
    return torch.cat([losses, losses.new_zeros(1)]), torch.cat([mask, mask.new_zeros(1)])
