"""`qvl launch RECIPE [key=value ...] --executor local|slurm|kubernetes [--dryrun]`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import yaml

from qvl.foundation.errors import LaunchError
from qvl.launchers.jobs import DEMO_JOB, EXECUTORS, launch
from qvl.launchers.os_errors import os_errors_as


def run_launch(args: argparse.Namespace) -> int:
    """`qvl launch`: print the dry run or where to follow the experiment."""
    from rich.console import Console

    console = Console()
    if args.resolve and not args.dryrun:
        raise LaunchError("--resolve goes with --dryrun (a submit always builds the config first); add --dryrun")
    # NeMo-Run prints its progress and experiment summary on stdout; with --json stdout is the result alone.
    where = args.experiments_dir or os.environ.get("NEMORUN_HOME") or "~/.nemo_run"
    again = "then run the same command again (a job that was already submitted shows in `nemo experiment list`)"
    stdout = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with stdout, os_errors_as(LaunchError, where=where, then=again):
        result = launch(
            args.recipe,
            args.overrides,
            train_flags=_train_flags(args),
            kind=args.executor,
            site_file=args.executor_config,
            dryrun=args.dryrun,
            resolve=args.resolve,
            name=args.name,
            experiments_dir=args.experiments_dir,
            wait=args.wait or None,
            task="reference" if args.reference else "train",
        )
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    if args.dryrun:  # written raw: the script must survive copy-paste, so no wrapping or markup
        console.rule(f"{result['executor']} request (dry run, nothing submitted)")
        sys.stdout.write(result["request"].rstrip("\n") + "\n")
        console.rule("resolved config" if args.resolve else "what the job runs (--resolve adds its config)")
        sys.stdout.write(yaml.safe_dump(result["config"], sort_keys=False))
        return 0
    home = f"NEMORUN_HOME={args.experiments_dir} " if args.experiments_dir else ""
    console.print(
        f"experiment [bold]{result['experiment']}[/] ({', '.join(result['states'])}; "
        f"{result['executor']} job {', '.join(result['job_ids'])})\n"
        f"  folder: {result['folder']}\n"
        f"  status: {home}nemo experiment status {result['experiment']}\n"
        f"  logs:   {home}nemo experiment logs {result['experiment']} 0\n"
        f"  cancel: {home}nemo experiment cancel {result['experiment']} 0",
        highlight=False,
    )
    return 0  # a job that was waited for and failed raised LaunchError: one `error:` line, exit 2


def _train_flags(args: argparse.Namespace) -> list[str]:
    return (["--model", args.model] if args.model else []) + (["--run-dir", args.run_dir] if args.run_dir else [])


def register(subparsers) -> None:
    """Add `qvl launch`."""
    parser = subparsers.add_parser(
        "launch",
        help="run a recipe locally, on Slurm or on Kubernetes through NeMo-Run",
        description="Run RECIPE with key=value overrides (recipe keywords such as tensor_parallel=4, nested "
        "config fields such as train.train_iters=100, executor fields such as run.executor.nodes=2).",
    )
    parser.add_argument(
        "recipe", help=f"a recipe name (`qvl recipes` lists them) or `{DEMO_JOB}`, the built-in tiny job"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe, config or run.executor.* overrides")
    parser.add_argument("--executor", choices=EXECUTORS, default="local", help="where to run (default local)")
    parser.add_argument(
        "--executor-config",
        metavar="SITE.yaml",
        help="YAML with local:/slurm:/kubernetes: sections of executor settings (no secrets)",
    )
    parser.add_argument(
        "--dryrun",
        action="store_true",
        help="print the sbatch script / TrainJob manifest / local command and what the job runs; submit nothing",
    )
    parser.add_argument(
        "--resolve",
        action="store_true",
        help="with --dryrun: also build the job's config here, as `qvl train` will, and print it (imports "
        "Megatron-Bridge: ~15 s)",
    )
    parser.add_argument(
        "--model", choices=("tiny",), help="passed to `qvl train`: a tiny random model of the recipe's family"
    )
    parser.add_argument(
        "--run-dir", help="passed to `qvl train`: checkpoints, losses, tensorboard on the execution side"
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="run `qvl reference` (a preference recipe's reference log-probs, at its layout) instead of `qvl train`",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait until the job ends; a job that fails (in the queue or running) is an error, exit status 2 "
        "(the default for --executor local)",
    )
    parser.add_argument("--json", action="store_true", help="print the result (or the dry run) as JSON")
    parser.add_argument("--name", help="experiment title (default qvl-RECIPE)")
    parser.add_argument("--experiments-dir", help="where NeMo-Run keeps experiments (default $NEMORUN_HOME)")
    parser.set_defaults(func=run_launch)
