"""Preference parity: a qvl `dpo` / `dpo_peft` recipe's steps against TRL's, from one HF checkpoint, on the same pairs.

`run_preference_parity` runs qvl's side as a user would (import, `qvl reference`, `qvl train` through Megatron-Bridge's
loop with qvl's preference step, packed pairs: qvl.training.parity.preference_megatron), then TRL 1.16's own trainer
on the same pairs unpacked (qvl.training.parity.preference_trl), and compares both with the SFT check's machinery
(step 1's per-token log-probs of every side and gradients by HF name, per-step losses, gradient norms and learning
rates, the final weights, the optimizers' weight decay), pair by pair (each side's policy and reference log-probs and
the pair's loss at every step) and step by step (the rewards both report: qvl.training.parity.preference_report).
docs/parity.md, "Preference training".
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qvl.foundation.errors import ConfigError
from qvl.kernels import fix_fla_tf32
from qvl.recipes.registry import PREFERENCE_STAGES, get_recipe
from qvl.training.parity import decay
from qvl.training.parity.adapters import adapter_notes
from qvl.training.parity.preference_report import PreferenceReport, preference_report
from qvl.training.parity.report import compare, gate_note
from qvl.training.parity.run import (
    ParitySpec,
    check_spec,
    cross_entropy_note,
    exact_fp32_note,
    exact_fp32_on,
    moe_aux,
    qvl_run,
    run_notes,
)

logger = logging.getLogger(__name__)
REFERENCES = {
    "precomputed": "qvl's reference pass (`qvl reference`) against TRL's reference model (a second copy of the checkpoint)",
    "adapters": "the policy with its adapters off on both sides (qvl reference=adapters, TRL's peft default)",
    "none": "none (SimPO is reference-free)",
}


def is_preference_recipe(recipe: str | None) -> bool:
    """Whether `recipe` trains on preference pairs (a `dpo` or `dpo_peft` stage)."""
    return recipe is not None and get_recipe(recipe).stage in PREFERENCE_STAGES


def run_preference_parity(spec: ParitySpec) -> PreferenceReport:
    """Train `spec.steps` steps of a preference recipe in qvl (packed) and in TRL (unpacked) and compare them."""
    from transformers import AutoConfig, AutoTokenizer

    from qvl.training.parity.preference_megatron import (
        IMPORT_DIR,
        REFERENCE_DIR,
        ensure_reference,
        import_checkpoint,
        preference_of,
        run_preference_megatron,
        with_start,
    )
    from qvl.training.parity.preference_pairs import pairs_per_step
    from qvl.training.parity.preference_trl import require_trl, run_trl, trl_loss
    from qvl.training.parity.transformers_run import reference_settings

    require_trl()
    family, device = check_preference_spec(spec)
    run = qvl_run(spec, family, device)
    given = spec.options.get("pretrained_checkpoint")
    start = Path(given) if given else import_checkpoint(spec.hf_path, run.run_dir / IMPORT_DIR, device=device)
    run = with_start(run, checkpoint=start, reference=None)
    settings = preference_of(run)
    loss = trl_loss(settings)  # refuses, before anything trains, what TRL has no loss for
    if settings.reference == "precomputed" and "reference" not in spec.options:
        run = with_start(run, checkpoint=start, reference=run.run_dir / REFERENCE_DIR)
    ensure_reference(run)
    logger.info("qvl: %d steps of %s on Megatron-Bridge, %d packs per step", spec.steps, run.recipe,
                run.global_batch_size)  # fmt: skip
    qvl, ours, config = run_preference_megatron(run)
    optimizer = reference_settings(config, weight_decay_rule=spec.weight_decay_rule)
    hf_config, tokenizer = (
        AutoConfig.from_pretrained(str(spec.hf_path)),
        AutoTokenizer.from_pretrained(str(spec.hf_path)),
    )
    steps = pairs_per_step(qvl, hf_config, tokenizer, seconds_per_grid=family.video_positions_in_seconds)
    logger.info("TRL: the same %d steps, %d pairs per step, one per micro-batch", spec.steps, len(steps[0]))
    with fix_fla_tf32.arithmetic(exact_fp32_on(config)):  # the reference computes as qvl's side did
        hf, theirs = run_trl(spec.hf_path, steps, optimizer, loss, Path(spec.run_dir) / "trl", adapters=qvl.adapters,
                             moe_aux=moe_aux(config))  # fmt: skip
    base = compare(qvl, hf, family=family.name, recipe=run.recipe, precision=spec.precision, peak_lr=optimizer.lr,
                   loss_relative=True, delta_rule=run.delta_rule)  # fmt: skip
    tokens = [
        tuple(int(getattr(p, side)["completion_mask"].sum()) for side in ("chosen", "rejected")) for p in steps[0]
    ]
    trainer = ("DPOTrainer" if loss.trainer == "dpo" else "CPOTrainer") + f" {loss.fields}"
    report = preference_report(base, ours, theirs, tokens=tokens, beta=settings.beta, trainer=trainer,
                               reference=REFERENCES[settings.reference])  # fmt: skip
    report.deliberate = preference_notes(hf, optimizer, family.moe and moe_aux(config)) + run_notes(spec, optimizer)
    report.deliberate += cross_entropy_note(config, spec, device) + gate_note(report) + adapter_notes(qvl.adapters)
    report.deliberate += exact_fp32_note(config)
    report.failures += decay.failure(qvl.decay, hf.decay)
    return report


def check_preference_spec(spec: ParitySpec):
    """The SFT check's refusals, and what only a preference check refuses."""
    if spec.loss_average != "token":
        raise ConfigError(
            f"--loss-average {spec.loss_average} is the SFT check's; a preference loss is the mean over the step's "
            "pairs on both sides: drop it"
        )
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ConfigError("the preference check runs on one process; start it without torchrun")
    return check_spec(spec)


def preference_notes(hf, optimizer, moe) -> list[str]:
    """What the preference comparison does on purpose."""
    notes = [
        "completions: TRL is given qvl's completion of each side (the last assistant turn's content and its "
        "<|im_end|>, read from the token ids); TRL's own collator would also learn the newline after <|im_end|>.",
        "pairs: one pair per TRL micro-batch, gradient accumulation over the step's pairs, so TRL's mean over "
        "micro-batches is the mean over the step's pairs, as qvl's step takes it however the pairs are packed.",
    ]
    if hf.decay_rules_differ:
        used = "Megatron's (the recipe's)" if optimizer.weight_decay_rule == "megatron" else "transformers'"
        notes.append(
            f"weight decay: Megatron-Core and transformers' Trainer differ on {len(hf.decay_rules_differ)} tensors "
            f"(e.g. {hf.decay_rules_differ[0]}); TRL's Trainer used {used} rule (--weight-decay-rule)."
        )
    if moe:
        kind, coefficient = moe
        notes.append(
            f"MoE load balancing: qvl adds Megatron-Core's {kind} (moe_aux_loss_coeff={coefficient:g}) per pack, "
            "weighed by the pack's pairs over the step's pairs (qvl.kernels.fix_preference_moe_aux); TRL's own "
            "(router_aux_loss_coef, transformers' definition) was off and the same loss was added on transformers' "
            "routers per pair; its value is compared at every step."
        )
    return notes
