"""`qvl recipes` (list every recipe), `qvl plan RECIPE [key=value ...] --gpus N --gpu h100`, `qvl train RECIPE` and
`qvl reference RECIPE` (a preference recipe's reference log-probs)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES
from qvl.launchers.os_errors import os_errors_as
from qvl.recipes.overrides import parse_overrides
from qvl.recipes.planner import GEMM_EFFICIENCY, GIB, plan_recipe
from qvl.recipes.registry import all_recipes, get_recipe
from qvl.recipes.split import Workload

PLAN_EPILOG = "overrides are recipe keyword arguments, e.g. tensor_parallel=4 recompute=full optimizer_offload=0.6"


def register(subparsers: Any) -> None:
    """Add the `recipes`, `plan` and `train` subcommands."""
    listing = subparsers.add_parser("recipes", help="list the recipe functions with their default layout")
    listing.add_argument("--family", choices=tuple(FAMILIES), help="only this family")
    listing.add_argument("--json", action="store_true", help="print the recipes as JSON")
    listing.set_defaults(func=run_recipes)
    plan = subparsers.add_parser(
        "plan", help="memory, pipeline split, FLOPs and MFU of a recipe per GPU", epilog=PLAN_EPILOG
    )
    plan.add_argument("recipe", help="a name from `qvl recipes`")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe keyword arguments")
    plan.add_argument("--gpus", type=int, help="number of GPUs (default: the recipe's planned count)")
    plan.add_argument("--gpu", default="h100", help="h100, h200 or a100 (default h100)")
    # The workload: the prepared dataset's own (data=DIR, its report.json), else these (defaults: an image SFT mix).
    plan.add_argument("--sample-tokens", type=int, help="mean conversation length in a pack (default 1024)")
    plan.add_argument("--vision-fraction", type=float, help="share of tokens that are image tokens (default 0.5)")
    plan.add_argument("--patches-per-image", type=int, help="ViT patches per image (default 1024 = 448 px)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run_plan)
    train = subparsers.add_parser("train", help="train a recipe through Megatron-Bridge (also tiny models on CPU)")
    train.add_argument("recipe", help="recipe name (`qvl recipes` lists them)")
    train.add_argument(
        "overrides",
        nargs="*",
        help="key=value recipe arguments (data=DIR train_iters=20) or section.field=value config fields",
    )
    train.add_argument("--model", choices=("tiny",), default=None, help="a tiny random model of the recipe's family")
    train.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces qvl's CPU runtime")
    train.add_argument(
        "--run-dir", default="runs/train", help="checkpoints, losses.jsonl, tensorboard (default runs/train)"
    )
    train.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="save a checkpoint and exit after N steps (resume by running the same command again)",
    )
    train.set_defaults(func=run_train)
    reference = subparsers.add_parser(
        "reference",
        help="a preference recipe's reference log-probs, computed once over its dataset before `qvl train`",
    )
    reference.add_argument("recipe", help="a dpo or dpo_peft recipe (`qvl recipes` lists them)")
    reference.add_argument(
        "overrides", nargs="*", help="the same key=value arguments as the `qvl train` that follows (data, hf_path, ...)"
    )
    reference.add_argument(
        "--model", choices=("tiny",), default=None, help="a tiny random model of the recipe's family"
    )
    reference.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces qvl's CPU runtime")
    reference.add_argument("--run-dir", default="runs/train", help="where --model tiny writes its checkpoint")
    reference.set_defaults(func=run_reference)


RECIPE_COLUMNS = ("recipe", "family", "size", "stage", "TP", "PP", "EP", "planned GPUs", "summary")


def recipe_rows(family: str | None = None) -> list[dict[str, Any]]:
    """One row per registered recipe (natural size order), as `qvl recipes --json` prints them."""

    rows = []
    for info in all_recipes():
        if family and info.family != family:
            continue
        lay = info.layout
        rows.append(
            {
                "recipe": info.name,
                "family": info.family,
                "size": info.size,
                "stage": info.stage,
                "TP": lay.get("tensor_parallel", 1),
                "PP": lay.get("pipeline_parallel", 1),
                "EP": lay.get("expert_parallel", 1),
                "planned GPUs": info.gpus,
                "summary": info.summary,
            }
        )
    return rows


def run_recipes(args: argparse.Namespace) -> int:
    """Print every registered recipe: a table on a terminal, whole names in plain columns into a pipe, or JSON."""
    # Importing the recipe modules imports Megatron, which may print; stdout carries the listing alone.
    with contextlib.redirect_stdout(sys.stderr):
        rows = recipe_rows(args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cells = [[("" if row[c] is None else str(row[c])) for c in RECIPE_COLUMNS] for row in rows]
    if not sys.stdout.isatty():  # a pipe or a file: tab-free aligned columns, never wrapped or cut
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(RECIPE_COLUMNS)]
        for line in [list(RECIPE_COLUMNS), *cells]:
            print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="qvl recipes (each returns a Megatron-Bridge ConfigContainer)")
    for column in RECIPE_COLUMNS:
        table.add_column(column, no_wrap=column == "recipe")
    for line in cells:
        table.add_row(*line)
    Console().print(table)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Plan a recipe; exit 1 when it does not fit or does not divide (the reasons and fixes are printed)."""

    overrides = parse_overrides(args.overrides).as_dict()
    info = get_recipe(args.recipe)
    gpus = (info.gpus or 8) if args.gpus is None else args.gpus
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1, e.g. --gpus 8")
    given = {
        "sample_tokens": args.sample_tokens,
        "vision_token_fraction": args.vision_fraction,
        "patches_per_image": args.patches_per_image,
    }
    given = {k: v for k, v in given.items() if v is not None}
    # seq_length is the recipe's; without flags the planner reads the dataset's workload (data=DIR) if there is one
    workload = Workload(seq_length=1, **given) if given else None
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        plan = plan_recipe(args.recipe, overrides, gpus=gpus, gpu=args.gpu, workload=workload)
    if args.json:
        print(json.dumps(plan_dict(args.recipe, plan), indent=2))
    else:
        print_plan(args.recipe, plan)
    return 0 if plan.fits else 1


def plan_dict(name: str, plan: Any) -> dict[str, Any]:
    """The plan as plain data (`qvl plan --json`): memory in GiB per stage, FLOPs, MFU, problems, suggestions."""

    return {
        "recipe": name,
        "gpus": plan.gpus,
        "gpu": plan.gpu.name,
        "layout": dict(plan.layout),
        "fits": plan.fits,
        "stages": [
            {
                "layers": s.layers,
                **{
                    f"{k}_gib": round(getattr(s, k) / GIB, 3)
                    for k in ("params", "grads", "optimizer", "activations", "overhead", "total")
                },
            }
            for s in plan.stages
        ],
        "stage_flops": plan.stage_flops,
        "params_total": plan.params_total,
        "params_trainable": plan.params_trainable,
        "model_flops_per_step": plan.model_flops_per_step,
        "step_time_s": plan.step_time_s,
        "mfu": plan.mfu,
        "vision_share": dict(plan.vision_share),
        "vision_balance": plan.vision_balance,
        "mtp_share": plan.mtp_share,
        "problems": list(plan.problems),
        "suggestions": list(plan.suggestions),
    }


def print_plan(name: str, plan: Any) -> None:
    """The plan as rich tables: memory per stage, then FLOPs and MFU, then problems and fixes."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    lay = plan.layout
    layout = " ".join(f"{k}={v}" for k, v in lay.items())
    memory = Table(title=f"{name} on {plan.gpus} x {plan.gpu.name}: {layout}")
    for column in (
        "pipeline stage",
        "LM layers",
        "params GiB",
        "grads GiB",
        "optimizer GiB",
        "activations GiB",
        "overhead GiB",
        "total GiB / GPU",
    ):
        memory.add_column(column, justify="right")
    usable = plan.gpu.memory_gib
    for s, stage in enumerate(plan.stages):
        extra = " (+ vision)" if s == 0 else ""
        total = stage.total / GIB
        memory.add_row(
            f"{s}{extra}",
            str(stage.layers),
            *(
                f"{x / GIB:.1f}"
                for x in (stage.params, stage.grads, stage.optimizer, stage.activations, stage.overhead)
            ),
            f"[{'red' if total > usable else 'green'}]{total:.1f}[/] of {usable:.1f}",
        )
    console.print(memory)
    split = "/".join(str(s.layers) for s in plan.stages)
    console.print(f"pipeline split (LM layers per stage, vision tower on stage 0): {split}")
    flops = plan.stage_flops
    if len(flops) > 1:
        console.print(
            "stage forward FLOPs per micro-batch: "
            + ", ".join(f"{f:.2e}" for f in flops)
            + f" (slowest / mean = {max(flops) / (sum(flops) / len(flops)):.2f})"
        )
    console.print(f"parameters: {plan.params_total / 1e9:.2f} B total, {plan.params_trainable / 1e9:.3f} B trainable")
    console.print(
        f"model FLOPs per step: {plan.model_flops_per_step:.3e}; estimated step time "
        f"{plan.step_time_s:.2f} s; MFU estimate {plan.mfu:.1%} (assumes {GEMM_EFFICIENCY:.0%} of peak "
        "in compute, pipeline bubble and unoverlapped TP/EP/DP traffic)"
    )
    if plan.vision_share:
        shares = ", ".join(f"{mode} {share:.1%}" for mode, share in plan.vision_share.items())
        console.print(f"vision share of a stage-0 rank's FLOPs: {shares} (vision_balance={plan.vision_balance})")
    if plan.mtp_share:
        console.print(f"multi-token prediction share of a step's FLOPs: {plan.mtp_share:.1%}")
    for problem in plan.problems:
        console.print(f"[red]refused:[/] {problem}")
    if plan.suggestions:
        console.print("fits with: " + "; ".join(plan.suggestions))
    elif plan.problems and any(p.startswith("does not fit") for p in plan.problems):
        console.print(
            "no single change fits; raise --gpus, or combine tensor_parallel/pipeline_parallel and recompute=full"
        )


def train_request(args: argparse.Namespace, **extra: Any) -> Any:
    """The TrainRequest of a `qvl train`-shaped command line (`qvl train`, `qvl reference`)."""
    from qvl.training.loop import TrainRequest  # torch

    return TrainRequest(
        recipe=args.recipe,
        overrides=parse_overrides(args.overrides).as_dict(),
        run_dir=Path(args.run_dir),
        model=args.model,
        device=args.device,
        **extra,
    )


def run_train(args: argparse.Namespace) -> int:
    from qvl.training.loop import read_losses, run_training  # torch

    request = train_request(args, stop_after=args.stop_after)
    # A full or vanished checkpoint folder fails inside Megatron's save (wrapped per rank by torch's distributed
    # checkpoint); the line names the folder and that the same command resumes from the last saved step.
    checkpoints = request.overrides.get("checkpoint_dir") or request.run_dir / "checkpoints"
    resume = f"then run the same command again: it resumes from the last checkpoint in {checkpoints}"
    with os_errors_as(ConfigError, where=checkpoints, then=resume):
        run_training(request)
    losses = read_losses(request.run_dir)
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        print(f"trained {len(losses)} steps: loss {first:.3f} -> {last:.3f}; run directory {request.run_dir}")
    return 0


def run_reference(args: argparse.Namespace) -> int:
    from qvl.training.reference import run_reference as compute  # torch

    out = compute(train_request(args))
    print(f"reference log-probs in {out}; `qvl train {args.recipe} ...` with the same arguments reads them")
    return 0
