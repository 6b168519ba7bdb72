"""`qvl verify-training HF_PATH --data DIR`: is qvl's training step the one transformers takes? (docs/parity.md)

Trains a few steps of the recipe on Megatron-Bridge (packed) and with transformers' Trainer (unpacked) from the same
checkpoint and samples (a preference recipe: with TRL's DPOTrainer or CPOTrainer, on the same pairs); prints per-step
losses and gradient norms of both, the per-token loss, gradient and final-weight differences (and each pair's
log-probs and rewards), and the conventions that differ on purpose; exit 1 above tolerance."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from qvl.recipes.overrides import parse_overrides

PLOT_NAME = "parity_loss.png"
PREFERENCE_PLOT = {"reference": "TRL (unpacked, a pair per micro-batch)", "ylabel": "preference loss per pair"}


def _spec(args: argparse.Namespace, run_dir: Path):
    from qvl.training.parity.run import ParitySpec

    return ParitySpec(
        hf_path=Path(args.hf_path),
        data=Path(args.data),
        run_dir=run_dir,
        recipe=args.recipe,
        steps=args.steps,
        options=parse_overrides(args.overrides).as_dict(),
        precision=args.precision,
        weight_decay_rule=args.weight_decay_rule,
        loss_average=args.loss_average,
        device=args.device,
        delta_rule=args.delta_rule,
    )


def _table(report) -> str:
    from qvl.training.parity.preference_report import preference_lines

    tol = report.tolerances
    lines = [
        f"{report.family} ({report.recipe}), {report.precision}: {report.conversations} conversations per step",
        f"{'step':>4}  {'loss qvl':>10}  {'loss hf':>10}  {'|diff|':>8}  {'gnorm qvl':>9}  {'gnorm hf':>9}  "
        f"{'rel diff':>8}  {'lr':>8}",
    ]
    for r in report.steps:
        lines.append(
            f"{r.step:>4}  {r.loss_qvl:>10.6f}  {r.loss_hf:>10.6f}  {r.loss_diff:>8.1e}  {r.grad_norm_qvl:>9.5f}  "
            f"{r.grad_norm_hf:>9.5f}  {r.grad_norm_rel_diff:>8.1e}  {r.lr_qvl:>8.2e}"
        )
    lines += [
        f"per-token loss (step 1): max |diff| {report.token_loss_max_diff:.1e} over {report.learned_tokens} learned "
        f"tokens (tolerance {tol.token_loss:.0e})",
        f"gradients (step 1, {report.tensors_compared} tensors by HF name): max rel diff "
        f"{report.grad_max_rel_diff:.1e} at {report.grad_worst} (tolerance {tol.grad:.0e})",
        *_mtp_lines(report),
        *_moe_aux_lines(report),
        *preference_lines(report),
        f"final weights: max |diff| {report.weight_max_diff:.1e} = {report.weight_max_diff / report.peak_lr:.3f} x "
        f"peak lr at {report.weight_worst} (tolerance {tol.weight} x lr)",
        "deliberate differences:",
        *[f"  - {note}" for note in report.deliberate],
    ]
    return "\n".join(lines)


def _mtp_lines(report) -> list[str]:
    """The MTP losses per step, where the multi-token-prediction head trained."""
    line = _per_step(report, "mtp_loss", "max |diff|", lambda r: r.mtp_loss_diff)
    return (
        [f"MTP loss (qvl / hf): {line}; {report.mtp_tensors} of the tensors above are the MTP head's"] if line else []
    )


def _moe_aux_lines(report) -> list[str]:
    """The load-balancing loss per step (as the routers add it, coefficient included), where it was on."""
    line = _per_step(report, "moe_aux_loss", "max rel diff", lambda r: r.moe_aux_loss_rel_diff)
    return [f"MoE load-balancing loss, summed over layers and packs (qvl / hf): {line}"] if line else []


def _per_step(report, field: str, measure: str, diff) -> str | None:
    """ "step N ours / theirs, ...; <measure> D (tolerance T)" for a per-step value both sides may record; None where
    neither side did."""
    pairs = [(r.step, getattr(r, f"{field}_qvl"), getattr(r, f"{field}_hf")) for r in report.steps]
    if all(ours is None and theirs is None for _, ours, theirs in pairs):
        return None
    values = ", ".join(
        f"step {step} {ours:.6f} / {theirs:.6f}"
        if ours is not None and theirs is not None
        else f"step {step} only one side"
        for step, ours, theirs in pairs
    )
    worst = max(diff(r) for r in report.steps)
    return f"{values}; {measure} {worst:.1e} (tolerance {report.tolerances.step_loss:.0e})"


def _plot_path(args: argparse.Namespace) -> Path | None:
    """Where the loss curves go: --plot, else parity_loss.png beside the --report file, else in --run-dir; never
    into the current folder unasked."""
    if args.plot:
        return Path(args.plot)
    folder = Path(args.report).parent if args.report else Path(args.run_dir) if args.run_dir else None
    return folder / PLOT_NAME if folder else None


def _plot_line(plot: Path | None, plotted: Path | None) -> str:
    if plotted:
        return f"loss curves: {plotted}"
    if plot:
        return "loss curves: none, matplotlib is not installed (pip install matplotlib); the figures are above"
    return "loss curves: pass --plot FILE, --report FILE or --run-dir DIR"


def run_verify_training(args: argparse.Namespace) -> int:
    from qvl.training.parity.preference import is_preference_recipe, run_preference_parity
    from qvl.training.parity.report import plot_losses
    from qvl.training.parity.run import run_parity

    # a dpo / dpo_peft recipe is checked against TRL's trainers, every other one against transformers' Trainer
    preference = is_preference_recipe(args.recipe)
    with contextlib.ExitStack() as stack:
        run_dir = Path(args.run_dir) if args.run_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        # Megatron prints its progress to stdout; with --json stdout carries the report alone, so it pipes into jq.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            report = (run_preference_parity if preference else run_parity)(_spec(args, run_dir))
    if args.report:
        Path(args.report).write_text(json.dumps(report.as_dict(), indent=2))
    plot = _plot_path(args)
    plotted = plot if plot and importlib.util.find_spec("matplotlib") is not None else None  # the `test` extra's
    if plotted:
        labels = PREFERENCE_PLOT if preference else {}
        plot_losses(report, plotted, **labels)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(_table(report))
        print(_plot_line(plot, plotted))
        print("OK" if report.ok else "FAILED:\n" + "\n".join(f"  {f}" for f in report.failures))
    return 0 if report.ok else 1


def register(subparsers) -> None:
    cmd = subparsers.add_parser(
        "verify-training",
        help="train a few steps in qvl and in transformers from one checkpoint and compare the steps",
        epilog="KEY=VALUE are recipe options or config fields, e.g. lr=1e-4 warmup_iters=1 "
        "model.cross_entropy_loss_fusion=true",
    )
    cmd.add_argument("hf_path", help="HF checkpoint directory (weights, tokenizer, processor)")
    cmd.add_argument("--data", required=True, help="a `qvl data prepare` output of a handful of samples")
    cmd.add_argument(
        "--recipe",
        help="recipe whose optimizer, schedule and loss settings to use (default: the family's SFT recipe); a dpo or "
        "dpo_peft recipe is checked against TRL on preference pairs",
    )
    cmd.add_argument("--steps", type=int, default=3, help="optimizer steps in each framework (default 3)")
    cmd.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 needs a GPU")
    cmd.add_argument(
        "--weight-decay-rule",
        choices=("megatron", "transformers"),
        default="megatron",
        help="the reference's decay groups: the recipe's (Megatron) or transformers' Trainer's own",
    )
    cmd.add_argument(
        "--loss-average",
        choices=("token", "conversation"),
        default="token",
        help="the reference's loss: per learned token of a step (the recipe's) or the Trainer's Qwen-VL default",
    )
    cmd.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")
    cmd.add_argument(
        "--delta-rule",
        choices=("recurrence", "chunked"),
        help="Qwen3.5-VL: qvl's Gated DeltaNet rule (default: the token-by-token recurrence where flash-linear-attention "
        "cannot run, its chunked kernels where it can); chunked is judged with wider decay-gate tolerances",
    )
    cmd.add_argument("--run-dir", help="keep both runs' files here (default: a temporary folder)")
    cmd.add_argument(
        "--plot", help=f"PNG of both loss curves (default: {PLOT_NAME} beside the --report file, else in --run-dir)"
    )
    cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    cmd.add_argument("--report", metavar="FILE", help="also write the JSON report to FILE")
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe options and config fields")
    cmd.set_defaults(func=run_verify_training)
