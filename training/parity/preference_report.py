"""Comparing a preference parity run pair by pair and step by step, on top of what the SFT comparison judges
(qvl.training.parity.report: step 1's per-token log-probs and gradients, per-step losses and gradient norms, the
final weights).

Per pair and step: each side's policy and reference log-probs and the pair's loss (qvl's as its loss code scored
them, TRL's summed from its policy's per-token log-probs, its own reference pass, its loss). Per step: the rewards
as each framework reported them (qvl's step metrics, TRL's `rewards/*` log), means over the step's pairs.

The pair values are sums over a side's learned tokens, so their fp32 tolerance scales with the tokens summed: a
side's log-prob may differ by `token_loss` per learned token (the SFT check's per-token tolerance); a reward by beta
times that over both sides; a loss keeps the step loss's tolerance, relative to its size above 1 (IPO's loss starts at
(1 / 2 beta)^2, 25 at beta 0.1). A step's reward accuracy may differ only by the pairs whose margin is within the
rewards' tolerance of 0 (where rounding may rank them either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qvl.training.parity.preference_pairs import REWARDS, PairRecord, Scores
from qvl.training.parity.report import ParityReport, _paired_diff


@dataclass(kw_only=True, slots=True)
class PreferenceReport(ParityReport):
    """The SFT comparison's report of a preference run, with its pairs and rewards compared."""

    trainer: str = ""  # TRL's trainer and loss, e.g. "DPOTrainer {'beta': 0.1, 'loss_type': ['sigmoid', 'sft'], ...}"
    reference: str = ""  # where each side's reference log-probs came from
    pairs_per_step: int = 0
    pair_max_diff: dict[str, float] = field(default_factory=dict)  # value -> max |qvl - TRL| over pairs and steps
    pair_worst: dict[str, str] = field(default_factory=dict)  # value -> "step s, pair k"
    pair_tolerance: dict[str, float] = field(default_factory=dict)  # value -> the largest tolerance it had
    step_rewards: list[dict] = field(default_factory=list)  # per step: REWARDS, qvl's and TRL's


def preference_report(
    base: ParityReport, ours: Scores, theirs: Scores, *, tokens: list[tuple[int, int]], beta: float, trainer: str,
    reference: str,
) -> PreferenceReport:  # fmt: skip
    """`base` with the pairs and rewards compared: both sides' scores in the same order (step, then the loop's order),
    `tokens` each pair's learned tokens (chosen, rejected) in the order of one step."""
    report = PreferenceReport(**{name: getattr(base, name) for name in ParityReport.__dataclass_fields__})
    report.trainer, report.reference, report.pairs_per_step = trainer, reference, len(tokens)
    if len(ours.pairs) != len(theirs.pairs) or len(ours.rewards) != len(theirs.rewards):
        report.failures.append(
            f"qvl scored {len(ours.pairs)} pairs over {len(ours.rewards)} steps, TRL {len(theirs.pairs)} over "
            f"{len(theirs.rewards)}"
        )
        return report
    tol = report.tolerances
    for k, (a, b) in enumerate(zip(ours.pairs, theirs.pairs, strict=True)):
        chosen, rejected = tokens[k % len(tokens)]
        bounds = {
            "loss": tol.step_loss * max(1.0, abs(b.loss)),
            "logp_chosen": tol.token_loss * chosen,
            "logp_rejected": tol.token_loss * rejected,
            "ref_logp_chosen": tol.token_loss * chosen,
            "ref_logp_rejected": tol.token_loss * rejected,
        }
        _judge(report, f"step {a.step}, pair {k % len(tokens)}", a, b, bounds)
    reward_bound = beta * tol.token_loss * max(c + r for c, r in tokens)
    for step, (a, b) in enumerate(zip(ours.rewards, theirs.rewards, strict=True), start=1):
        pairs = [p for p in ours.pairs if p.step == step]
        bounds = {name: reward_bound for name in REWARDS}
        # a pair whose margin is within the rewards' tolerance of 0 may be ranked either way
        bounds["reward_accuracy"] = sum(abs(p.reward_margin) <= reward_bound for p in pairs) / len(pairs) + 1e-9
        _judge(report, f"step {step}", a, b, bounds)
        row = {"step": step} | {f"{name}_qvl": a[name] for name in REWARDS}
        report.step_rewards.append(row | {f"{name}_trl": b[name] for name in REWARDS})
    return report


def _judge(report: PreferenceReport, where: str, ours, theirs, bounds: dict[str, float]) -> None:
    """Each value of `bounds` compared on both sides (PairRecord fields or a step's reward dict), worst kept."""
    for name, bound in bounds.items():
        a, b = (getattr(x, name) if isinstance(x, PairRecord) else x[name] for x in (ours, theirs))
        diff = _paired_diff(a, b)
        if diff >= report.pair_max_diff.get(name, 0.0):
            report.pair_max_diff[name], report.pair_worst[name] = diff, where
        report.pair_tolerance[name] = max(report.pair_tolerance.get(name, 0.0), bound)
        if diff > bound:
            report.failures.append(f"{where}: {name} {a} (qvl) vs {b} (TRL)")


def preference_lines(report) -> list[str]:
    """The pair comparison for `qvl verify-training`'s table (nothing for an SFT report)."""
    if not isinstance(report, PreferenceReport):
        return []
    lines = [
        f"pairs: {report.pairs_per_step} per step against TRL's {report.trainer}; reference: {report.reference}",
        f"{'step':>4}  {'acc qvl':>7}  {'acc trl':>7}  {'margin qvl':>10}  {'margin trl':>10}  {'chosen qvl':>10}  "
        f"{'chosen trl':>10}",
    ]
    for row in report.step_rewards:
        lines.append(
            f"{row['step']:>4}  {row['reward_accuracy_qvl']:>7.3f}  {row['reward_accuracy_trl']:>7.3f}  "
            f"{row['reward_margin_qvl']:>10.6f}  {row['reward_margin_trl']:>10.6f}  {row['reward_chosen_qvl']:>10.6f}  "
            f"{row['reward_chosen_trl']:>10.6f}"
        )
    worst = ", ".join(
        f"{name} {diff:.1e} (tolerance {report.pair_tolerance[name]:.0e})"
        for name, diff in report.pair_max_diff.items()
    )
    lines.append(f"per pair and step, max |diff|: {worst}")
    return lines
