"""The proof of an adapter export: the files written, loaded as a user loads them (transformers + `peft` with the
adapter, or the merged checkpoint with transformers alone), against the model the run trained, loaded from its
checkpoint as training resumes (qvl.bridges.trained); fp32 logits on inputs built from HF_BASE's config.

The exporter (qvl.bridges.adapter_export) rebuilds the model its own way, from HF_BASE's weights and the run's adapter
tensors. Compared with that rebuilt model, a defect in how the exporter reads the run (the vision adapters skipped,
two experts' adapters swapped, an expert-parallel checkpoint read wrong) would pass: the file and the rebuilt model
would be wrong alike. Against the trained model it fails (tests/training/test_train_peft.py breaks it on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qvl.bridges import trained
from qvl.bridges.adapter_export import (
    ADAPTER_WEIGHTS,
    AdapterRun,
    build_adapted_model,
    find_adapter_run,
    hf_base_of,
    write_adapter,
    write_merged,
)

# fp32 CPU logit parity of the tiny models is ~1e-6 with trained adapters (the base conversion's is ~3e-7).
DEFAULT_TOLERANCE = 1e-5
CHECKED_AGAINST = "the trained model, loaded from the run's checkpoint as training resumes"


@dataclass(kw_only=True, slots=True)
class ExportReport:
    """What the export's check measured (fp32 logits on config-built inputs); `ok` against `tolerance`."""

    adapter: str | None  # the peft adapter folder written, if any
    merged: str | None  # the merged HF checkpoint written, if any
    checked: bool
    adapter_effect: float | None = None  # max |trained logits with adapters - without|: what the check could see
    adapter_max_abs_diff: float | None = None  # trained model's logits vs transformers + peft with the adapter
    merged_max_abs_diff: float | None = None  # trained model's logits vs transformers with the merged checkpoint
    missing_keys: list[str] = field(default_factory=list)  # adapter tensors peft expected and the file lacks
    unexpected_keys: list[str] = field(default_factory=list)  # file tensors peft has no place for
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ok(self) -> bool:
        diffs = [d for d in (self.adapter_max_abs_diff, self.merged_max_abs_diff) if d is not None]
        return all(d <= self.tolerance for d in diffs) and not self.missing_keys and not self.unexpected_keys

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__} | {"ok": self.ok, "against": CHECKED_AGAINST}


def peft_logits(hf_base: Path, adapter_dir: Path, inputs: dict) -> tuple[torch.Tensor, list[str], list[str]]:
    """(logits of transformers + peft with the adapter, fp32; adapter tensors it expected that the file lacks;
    tensors in the file it has no place for)."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(str(hf_base), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False).eval()
    expected = set(get_peft_model_state_dict(model).keys())
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="pt") as f:
        written = set(f.keys())
    with torch.no_grad():
        logits = model(**inputs).logits.float()
    return logits, sorted(expected - written), sorted(written - expected)


def max_diff(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Max |difference| of two logit tensors (ours may carry vocabulary padding)."""
    return float((ours[..., : reference.shape[-1]] - reference).abs().max())


def trained_reference(run: AdapterRun, inputs: dict) -> tuple[torch.Tensor, float]:
    """(the trained model's fp32 logits on `inputs`, how far its adapters move them), one rank (TP=1, PP=1)."""
    ours, without = trained.trained_logits(run.checkpoints, inputs)
    return ours, float((ours - without).abs().max())


def export_adapter_on_rank(
    run_path: str, hf_base: str | None, out: str | None, merged_out: str | None, check: bool, tolerance: float | None
) -> dict[str, Any]:
    """Write the run's adapters as a peft adapter to `out` and/or folded into a full HF checkpoint at `merged_out`,
    each checked against the trained model when `check`; the report as a dict (module level, so ranks import it)."""
    from qvl.bridges import verify

    run = find_adapter_run(Path(run_path))
    base = hf_base_of(run, hf_base)
    bridge, model, _ = build_adapted_model(run, base)
    report = ExportReport(adapter=out, merged=merged_out, checked=check, tolerance=tolerance or DEFAULT_TOLERANCE)
    if out:
        write_adapter(run, bridge, model, base, Path(out))
    if merged_out:
        write_merged(bridge, model, base, Path(merged_out))  # folds the adapters in
    del model, bridge  # the check builds the trained model anew
    if check:
        inputs = verify.config_inputs(base)
        ours, report.adapter_effect = trained_reference(run, inputs)
        if out:
            reference, report.missing_keys, report.unexpected_keys = peft_logits(base, Path(out), inputs)
            report.adapter_max_abs_diff = max_diff(ours, reference)
        if merged_out:
            report.merged_max_abs_diff = max_diff(ours, verify.hf_logits(Path(merged_out), inputs))
    return report.as_dict()
