"""Comparing the two recordings: per-token losses, step-1 gradients, per-step losses and norms, final weights.

Tolerances are stated per precision. fp32 on CPU: what the two frameworks' different summation orders leave
(measured on the tiny models of every family, docs/parity.md); bf16: the width of bf16 rounding over a
few steps, for a GPU run (an estimate from bf16's 8-bit mantissa, not measured here).

The decay-gate parameters of a Gated DeltaNet (Qwen3.5-VL's `linear_attn.A_log`, `dt_bias`, `in_proj_a`) are named
and reported apart, `gate_grad` / `gate_weight`. In fp32 they keep the common tolerances: both sides run the delta
rule token by token (where fla cannot run), whose gate gradients are within fp32 rounding of exact; the chunked rule
the frameworks use for speed is ~1e-3 off on them (measured against fp64, qvl.training.parity.exact; the kernel
tests show why), so a check with it on both sides would compare one algorithm's error with itself. Where qvl's side
runs a chunked rule (fla's kernels on a GPU; `delta_rule="chunked"` on the CPU) against transformers' recurrence,
the gates are judged with `CHUNKED_GATES` in fp32 (every other tensor keeps the fp32 tolerances), and with the bf16
ones in bf16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from qvl.training.parity.megatron_run import Recording


@dataclass(kw_only=True, slots=True, frozen=True)
class Tolerances:
    """How far qvl's run may be from transformers' and still pass."""

    token_loss: float  # max |difference| of one learned token's loss at step 1
    step_loss: float  # max |difference| of a step's loss
    grad_norm: float  # max relative difference of a step's gradient norm (before clipping)
    grad: float  # max over tensors of |g_qvl - g_hf| / (|g_hf| + 1e-6 |G_hf|), step 1, after clipping
    weight: float  # max |difference| of a final weight, in units of the peak learning rate
    gate_grad: float  # `grad` for GATE_PARAMETERS (module docstring)
    gate_weight: float  # `weight` for GATE_PARAMETERS: Adam turns their gradient noise into update noise


TOLERANCES = {
    "fp32": Tolerances(
        token_loss=1e-5, step_loss=1e-5, grad_norm=1e-5, grad=1e-4, weight=0.1, gate_grad=1e-4, gate_weight=0.1
    ),
    "bf16": Tolerances(
        token_loss=5e-2, step_loss=2e-2, grad_norm=5e-2, grad=1e-1, weight=1.0, gate_grad=1e-1, gate_weight=1.0
    ),
}
# fp32, qvl's side on a chunked delta rule and transformers' on the recurrence: the decay gates keep the chunked rule's
# own error. Measured on the CPU with Megatron-Core's torch chunked kernel (the tiny Qwen3.5-VL models, the parity
# samples, 3 steps): gradients 1.3e-3 (dense) and 2.0e-4 (MoE) relative, final weights 0.14 and 0.15 lr; fla's
# kernels on a GPU are measured against fp64 by tests/training/test_parity_gated_delta.py. Bounds ~8x and ~3x above.
CHUNKED_GATES = {"gate_grad": 1e-2, "gate_weight": 0.5}
DELTA_RULES = ("recurrence", "chunked")  # the delta rule qvl's side ran (transformers' always runs the recurrence)
# HF-name fragments of the Gated DeltaNet decay-gate parameters, g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias):
# their gradients sum tiny, sign-changing contributions of every token through the recurrent state.
GATE_PARAMETERS = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.")


def tolerances(precision: str, delta_rule: str = "recurrence") -> Tolerances:
    """The tolerances of a check in `precision` whose qvl side ran `delta_rule` (a key of DELTA_RULES)."""
    tol = TOLERANCES[precision]
    return replace(tol, **CHUNKED_GATES) if delta_rule == "chunked" and precision == "fp32" else tol


def is_gate_parameter(name: str) -> bool:
    return any(fragment in name for fragment in GATE_PARAMETERS)


def _paired_diff(ours: float | None, theirs: float | None) -> float:
    if ours is None and theirs is None:
        return 0.0
    if ours is None or theirs is None:
        return float("inf")
    return abs(ours - theirs)


@dataclass(kw_only=True, slots=True)
class StepRow:
    """One optimizer step in both frameworks."""

    step: int
    loss_qvl: float
    loss_hf: float
    grad_norm_qvl: float
    grad_norm_hf: float
    lr_qvl: float
    lr_hf: float
    mtp_loss_qvl: float | None = None  # with the MTP head trained: its learned-token mean loss
    mtp_loss_hf: float | None = None
    moe_aux_loss_qvl: float | None = None  # with the load-balancing loss on: as the routers add it (x coeff)
    moe_aux_loss_hf: float | None = None

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_qvl - self.loss_hf)

    @property
    def mtp_loss_diff(self) -> float:
        """|difference| of the MTP losses; inf where only one side trained the head, 0 where neither did."""
        return _paired_diff(self.mtp_loss_qvl, self.mtp_loss_hf)

    @property
    def moe_aux_loss_rel_diff(self) -> float:
        """Relative difference of the load-balancing losses (a sum over layers and packs); inf where only one side
        has it, 0 where neither does."""
        return _paired_diff(self.moe_aux_loss_qvl, self.moe_aux_loss_hf) / max(abs(self.moe_aux_loss_hf or 0), 1e-12)

    @property
    def grad_norm_rel_diff(self) -> float:
        return abs(self.grad_norm_qvl - self.grad_norm_hf) / max(self.grad_norm_hf, 1e-12)


@dataclass(kw_only=True, slots=True)
class ParityReport:
    """What `compare` measured, the conventions it found different on purpose, and the verdict."""

    family: str
    recipe: str
    precision: str
    tolerances: Tolerances
    steps: list[StepRow]
    conversations: int  # per step
    learned_tokens: int  # at step 1, by transformers' labels
    token_loss_max_diff: float
    mask_mismatches: list[str]
    grad_max_rel_diff: float  # over every tensor but GATE_PARAMETERS
    grad_worst: str
    tensors_compared: int
    weight_max_diff: float  # absolute, every tensor but GATE_PARAMETERS
    weight_worst: str
    peak_lr: float
    delta_rule: str = "recurrence"  # qvl's side's Gated DeltaNet rule (DELTA_RULES); without one: recurrence
    gate_tensors: int = 0  # GATE_PARAMETERS tensors compared with the gate tolerances
    mtp_tensors: int = 0  # the multi-token-prediction head's tensors (`mtp.*`) among those compared
    gate_grad_max_rel_diff: float = 0.0
    gate_grad_worst: str = ""
    gate_weight_max_diff: float = 0.0
    gate_weight_worst: str = ""
    # the step loss judged relative to its size above 1 (a preference loss: IPO's starts at (1 / 2 beta)^2 = 25,
    # where fp32 rounding alone reaches the absolute tolerance)
    loss_relative: bool = False
    deliberate: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        out = asdict(self)
        out["steps"] = [
            {
                **asdict(r),
                "loss_diff": r.loss_diff,
                "mtp_loss_diff": r.mtp_loss_diff,
                "moe_aux_loss_rel_diff": r.moe_aux_loss_rel_diff,
                "grad_norm_rel_diff": r.grad_norm_rel_diff,
            }
            for r in self.steps
        ]
        return {**out, "ok": self.ok}


def token_loss_diffs(qvl: Recording, hf: Recording) -> tuple[float, list[str]]:
    """Max per-token loss difference over learned tokens, and the conversations whose learned tokens differ."""
    if len(qvl.token_losses) != len(hf.token_losses):
        return float("inf"), [f"{len(qvl.token_losses)} conversations against {len(hf.token_losses)}"]
    worst, mismatches = 0.0, []
    for k, ((ours, our_mask), (ref, ref_mask)) in enumerate(zip(qvl.token_losses, hf.token_losses, strict=True)):
        if ours.shape != ref.shape or not torch.equal(our_mask, ref_mask):
            extra = (our_mask & ~ref_mask).nonzero().flatten().tolist()
            missing = (ref_mask & ~our_mask).nonzero().flatten().tolist()
            mismatches.append(
                f"conversation {k}: learned only by qvl at {extra[:5]}, only by transformers {missing[:5]}"
            )
            continue
        worst = max(worst, float((ours - ref).abs().max()))
    return worst, mismatches


def grad_diffs(qvl: Recording, hf: Recording) -> tuple[dict[bool, tuple[float, str]], list[str]]:
    """Worst relative gradient difference and its name, for the gate parameters (True) and every other HF
    parameter (False), and the names one side lacks."""
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in hf.grads.values()))
    worst = {False: (0.0, ""), True: (0.0, "")}
    missing = sorted(set(hf.grads) ^ set(qvl.grads))
    for name in sorted(set(hf.grads) & set(qvl.grads)):
        ref, ours = hf.grads[name].double(), qvl.grads[name].double()
        if ref.shape != ours.shape:
            missing.append(f"{name} (shape {tuple(ours.shape)} vs {tuple(ref.shape)})")
            continue
        rel = float((ours - ref).norm() / (ref.norm() + 1e-6 * total))
        gate = is_gate_parameter(name)
        if rel > worst[gate][0]:
            worst[gate] = (rel, name)
    return worst, missing


def weight_diffs(qvl: Recording, hf: Recording) -> tuple[dict[bool, tuple[float, str]], list[str]]:
    """Worst absolute difference of the final weights and its name, gate parameters (True) and the others (False),
    and the names one side lacks."""
    worst = {False: (0.0, ""), True: (0.0, "")}
    missing = sorted(set(hf.weights) - set(qvl.weights))
    for name in sorted(set(hf.weights) & set(qvl.weights)):
        diff = float((qvl.weights[name] - hf.weights[name]).abs().max())
        gate = is_gate_parameter(name)
        if diff > worst[gate][0]:
            worst[gate] = (diff, name)
    return worst, missing


def compare(
    qvl: Recording, hf: Recording, *, family: str, recipe: str, precision: str, peak_lr: float,
    loss_relative: bool = False, delta_rule: str = "recurrence",
) -> ParityReport:  # fmt: skip
    """The parity report of qvl's recording against transformers', judged with the precision's tolerances (the step
    loss's relative to its size above 1 with `loss_relative`; the gates' for qvl's `delta_rule`)."""
    tol = tolerances(precision, delta_rule)
    token_diff, masks = token_loss_diffs(qvl, hf)
    grads, grads_missing = grad_diffs(qvl, hf)
    weights, weights_missing = weight_diffs(qvl, hf)
    compared = set(hf.grads) & set(qvl.grads)
    rows = [
        StepRow(
            step=a.step,
            loss_qvl=a.loss,
            loss_hf=b.loss,
            grad_norm_qvl=a.grad_norm,
            grad_norm_hf=b.grad_norm,
            lr_qvl=a.lr,
            lr_hf=b.lr,
            mtp_loss_qvl=a.mtp_loss,
            mtp_loss_hf=b.mtp_loss,
            moe_aux_loss_qvl=a.moe_aux_loss,
            moe_aux_loss_hf=b.moe_aux_loss,
        )
        for a, b in zip(qvl.steps, hf.steps, strict=True)
    ]
    report = ParityReport(
        family=family,
        recipe=recipe,
        precision=precision,
        tolerances=tol,
        steps=rows,
        conversations=len(hf.token_losses),
        learned_tokens=int(sum(int(m.sum()) for _, m in hf.token_losses)),
        token_loss_max_diff=token_diff,
        mask_mismatches=masks,
        grad_max_rel_diff=grads[False][0],
        grad_worst=grads[False][1],
        tensors_compared=len(compared),
        weight_max_diff=weights[False][0],
        weight_worst=weights[False][1],
        peak_lr=peak_lr,
        delta_rule=delta_rule,
        loss_relative=loss_relative,
        gate_tensors=sum(map(is_gate_parameter, compared)),
        mtp_tensors=sum(name.startswith("mtp.") for name in compared),
        gate_grad_max_rel_diff=grads[True][0],
        gate_grad_worst=grads[True][1],
        gate_weight_max_diff=weights[True][0],
        gate_weight_worst=weights[True][1],
    )
    report.failures = _failures(report, tol, grads_missing + weights_missing)
    return report


def _failures(r: ParityReport, tol: Tolerances, missing: list[str]) -> list[str]:
    checks = [
        (not r.mask_mismatches, f"learned tokens differ: {'; '.join(r.mask_mismatches)}"),
        (r.token_loss_max_diff <= tol.token_loss, f"per-token loss differs by {r.token_loss_max_diff:.3g}"),
        (not missing, f"tensors only one side has: {', '.join(missing[:5])}"),
        (r.grad_max_rel_diff <= tol.grad, f"gradient of {r.grad_worst} differs by {r.grad_max_rel_diff:.3g} (rel)"),
        (
            r.weight_max_diff <= tol.weight * r.peak_lr,
            f"final weight {r.weight_worst} differs by {r.weight_max_diff:.3g} ({r.weight_max_diff / r.peak_lr:.3g} lr)",
        ),
        (
            r.gate_grad_max_rel_diff <= tol.gate_grad,
            f"gradient of {r.gate_grad_worst} differs by {r.gate_grad_max_rel_diff:.3g} (rel, gate tolerance)",
        ),
        (
            r.gate_weight_max_diff <= tol.gate_weight * r.peak_lr,
            f"final weight {r.gate_weight_worst} differs by {r.gate_weight_max_diff:.3g} "
            f"({r.gate_weight_max_diff / r.peak_lr:.3g} lr, gate tolerance)",
        ),
    ]
    for row in r.steps:
        bound = tol.step_loss * (max(1.0, abs(row.loss_hf)) if r.loss_relative else 1.0)
        checks.append((row.loss_diff <= bound, f"step {row.step} loss differs by {row.loss_diff:.3g}"))
        checks.append(
            (row.mtp_loss_diff <= tol.step_loss, f"step {row.step} MTP loss differs by {row.mtp_loss_diff:.3g}")
        )
        checks.append(
            (
                row.moe_aux_loss_rel_diff <= tol.step_loss,
                f"step {row.step} load-balancing loss differs by {row.moe_aux_loss_rel_diff:.3g} (rel)",
            )
        )
        checks.append(
            (
                row.grad_norm_rel_diff <= tol.grad_norm,
                f"step {row.step} gradient norm differs by {row.grad_norm_rel_diff:.3g} (rel)",
            )
        )
        checks.append(
            (abs(row.lr_qvl - row.lr_hf) <= 1e-6 * r.peak_lr, f"step {row.step} lr {row.lr_qvl:.3g} vs {row.lr_hf:.3g}")
        )
    return [message for passed, message in checks if not passed]


_RULE_WORDS = {
    "recurrence": "both sides ran the delta rule token by token (the chunked rule's gate gradients are ~1e-3 from "
    "exact: docs/parity.md).",
    "chunked": "qvl's side ran a chunked delta rule (fla's kernels on a GPU, Megatron-Core's torch kernel on the CPU) "
    "and transformers' the token-by-token recurrence, so the gates keep the chunked rule's own error (docs/parity.md).",
}


def gate_note(report: ParityReport) -> list[str]:
    """The named gate tolerance, where the model has gate parameters, with what this run measured on them."""
    if not report.gate_tensors:
        return []
    tol = report.tolerances
    return [
        f"gate parameters: the Gated DeltaNet's decay gate ({', '.join(f.rstrip('.') for f in GATE_PARAMETERS)}; {report.gate_tensors} "
        f"tensors), judged with gradients {tol.gate_grad:.0e} relative and final weights {tol.gate_weight:g} x lr "
        f"(every other tensor {tol.grad:.0e} and {tol.weight:g} x lr); {_RULE_WORDS[report.delta_rule]} This run: "
        f"{report.gate_grad_max_rel_diff:.1e} at {report.gate_grad_worst}, final weights "
        f"{report.gate_weight_max_diff / report.peak_lr:.3f} x lr at {report.gate_weight_worst}."
    ]


def plot_losses(
    report: ParityReport, path, *, reference: str = "transformers Trainer (unpacked)",
    ylabel: str = "loss per learned token",
) -> None:  # fmt: skip
    """Both frameworks' loss curves in one PNG (`reference` names the other side's curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in report.steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.loss_hf for r in report.steps], "o-", label=reference, lw=3, alpha=0.5)
    ax.plot(steps, [r.loss_qvl for r in report.steps], "x--", label="qvl on Megatron-Bridge (packed)")
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=f"{report.family}: {report.recipe}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
