"""Preference training (DPO and its variants): the settings of a `dpo` / `dpo_peft` recipe, checked where they are
given, and the dataset they read.

A preference recipe trains on a dataset of pairs (`qvl data prepare` on preference records: each pack holds whole
pairs, chosen side first) against reference log-probs: computed ahead by `qvl reference` over the same dataset from
the recipe's pretrained checkpoint (the SFT result) and read with the packs, so the reference costs no memory and no
time during training; or, for an adapter recipe, the same model with its adapters switched off (one extra forward per
micro-batch, no second model). SimPO needs no reference. The losses follow TRL 1.16's `DPOTrainer` (sigmoid,
robust, IPO, hinge; the NLL term of RPO) and `CPOTrainer` (SimPO); qvl.training.preference_loss computes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qvl.foundation.errors import ConfigError, DataError

LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
LOGPS = ("sum", "mean")  # a side's log-prob: summed over its learned tokens, or their mean
REFERENCES = ("precomputed", "adapters", "none")
REFERENCE_FREE = ("simpo",)
REFERENCE_DIR = "reference"  # under the dataset: where `qvl reference` writes by default
ADAPTERS = "adapters"  # reference=adapters: the policy with its adapters switched off


@dataclass(kw_only=True, slots=True)
class PreferenceConfig:
    """How a preference stage scores a pair (qvl.training.preference_loss) and where its reference comes from."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid: conservative DPO; robust: the flip rate rDPO corrects for; simpo too
    nll_weight: float = 0.0  # RPO: + weight x the chosen side's mean token NLL
    simpo_gamma: float = 0.5  # SimPO's target margin (CPOTrainer's simpo_gamma)
    logp: str = "sum"  # a side's log-prob: "sum" (DPO) or "mean" over its learned tokens (SimPO and IPO always mean)
    reference: str = "precomputed"  # precomputed (qvl reference), adapters (PEFT: adapters off) or none (SimPO)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("dpo_loss", self.loss, LOSSES),
            ("dpo_logp", self.logp, LOGPS),
            ("reference", self.reference, REFERENCES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not supported; use one of: {', '.join(allowed)}")
        if self.beta <= 0:
            raise ConfigError(f"dpo_beta={self.beta} must be positive (published DPO uses 0.1)")
        limit = 0.5 if self.loss == "robust" else 1.0
        if not 0.0 <= self.label_smoothing < limit:
            raise ConfigError(
                f"dpo_label_smoothing={self.label_smoothing} must be in [0, {limit}) for dpo_loss={self.loss}"
            )
        if self.nll_weight < 0:
            raise ConfigError(f"dpo_nll_weight={self.nll_weight} must be >= 0 (RPO uses 1.0; 0 turns it off)")
        if self.loss in ("ipo", "hinge") and self.label_smoothing:
            raise ConfigError(f"dpo_label_smoothing does not apply to dpo_loss={self.loss}; drop it")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model (all but SimPO)."""
        return self.loss not in REFERENCE_FREE


def preference_config(options: Any, *, adapters: bool) -> PreferenceConfig:
    """The stage's PreferenceConfig from recipe options (`dpo_loss`, `dpo_beta`, ..., `reference`)."""
    reference = options.reference
    if options.dpo_loss in REFERENCE_FREE:
        if reference not in (None, "none"):
            raise ConfigError(f"dpo_loss={options.dpo_loss} needs no reference; drop reference={reference}")
        kind = "none"
    elif reference == ADAPTERS:
        if not adapters:
            raise ConfigError(
                "reference=adapters is the policy with its adapters switched off: it needs an adapter recipe "
                "(*_dpo_peft); for full fine-tuning precompute the reference with `qvl reference RECIPE ...`"
            )
        kind = ADAPTERS
    elif reference == "none":
        raise ConfigError(f"dpo_loss={options.dpo_loss} compares with a reference; pass reference=DIR or use simpo")
    else:
        kind = "precomputed"
    return PreferenceConfig(
        loss=options.dpo_loss,
        beta=options.dpo_beta,
        label_smoothing=options.dpo_label_smoothing,
        nll_weight=options.dpo_nll_weight,
        simpo_gamma=options.simpo_gamma,
        logp=options.dpo_logp,
        reference=kind,
    )


def reference_dir(options: Any) -> Path | None:
    """Where a precomputed reference is read (and `qvl reference` writes): `reference=DIR`, else DATA/reference."""
    if options.reference not in (None, ADAPTERS, "none"):
        return Path(options.reference)
    return Path(options.data) / REFERENCE_DIR if options.data else None


def check_preference_dataset(path: str | Path | None) -> None:
    """Refuse an SFT dataset for a preference recipe (report.json says what `qvl data prepare` wrote)."""
    if path is None:
        return
    report = Path(path) / "report.json"
    kind = json.loads(report.read_text()).get("kind", "sft") if report.is_file() else None
    if kind is not None and kind != "preference":
        raise DataError(
            f"data={path} holds {kind} conversations, not preference pairs; prepare pairs with `qvl data prepare "
            "--kind preference ...` (records with chosen and rejected answers)"
        )


def one_epoch_iters(path: str | Path | None, global_batch_size: int) -> int | None:
    """Optimizer steps that read every pack of a prepared dataset once (published DPO trains one epoch)."""
    report = Path(path) / "report.json" if path else None
    if report is None or not report.is_file():
        return None
    packs = json.loads(report.read_text()).get("packed_sequences")
    return max(1, -(-int(packs) // global_batch_size)) if packs else None
