"""The `qvl` command line.

Each product area owns its subcommands: a module listed in COMMAND_MODULES exposes
`register(subparsers)` and sets `func(args) -> int` on each parser it adds. Groups whose module has
not landed yet answer with the issue that tracks them instead of pretending to work.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

COMMAND_MODULES = (
    "qvl.launchers.info",  # version, doctor
    "qvl.launchers.demo",  # demo
    "qvl.data.cli",  # data prepare | stats
    "qvl.bridges.cli",  # convert import | export | verify
    "qvl.recipes.cli",  # recipes, plan
    "qvl.recipes.train",  # train
    "qvl.launchers.launch",  # launch
)

# Command groups the product needs, with the issue that delivers each; shown until its module lands.
PLANNED_GROUPS = {
    "convert": ("HF <-> Megatron checkpoint conversion and logit parity", 3),
    "data": ("conversations -> validated, token-counted, packed Energon dataset", 4),
    "launch": ("run a recipe locally, on Slurm or Kubernetes through NeMo-Run", 5),
    "recipes": ("list the recipe functions", 6),
    "plan": ("memory and FLOP planner for a recipe", 6),
    "train": ("train a recipe (also on CPU with a tiny model)", 6),
}


def build_parser() -> argparse.ArgumentParser:
    """The full `qvl` parser with every available command group registered."""
    parser = argparse.ArgumentParser(
        prog="qvl",
        description="Qwen-VL training recipes on Megatron-Bridge: convert, prepare data, plan, train, launch.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:  # a real missing dependency inside the module: surface it
                raise
            continue
        module.register(subparsers)
    for name, (summary, issue) in PLANNED_GROUPS.items():
        if name not in subparsers.choices:
            planned = subparsers.add_parser(name, help=f"{summary} (not in this version yet: issue #{issue})")
            planned.set_defaults(func=_not_available(name, issue))
    return parser


def _not_available(name: str, issue: int):
    def run(args: argparse.Namespace) -> int:
        print(f"qvl {name} is not available in this version yet; it is tracked in issue #{issue}.", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qvl` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # qvl's own logs at INFO; Megatron's INFO chatter and fallback warnings only with --verbose.
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("qvl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
