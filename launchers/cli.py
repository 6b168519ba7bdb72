"""The `qvl` command line: the command table, logging set-up, and errors turned into one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
import warnings

from qvl.foundation.errors import QvlError

# The command table: one module per command group, each exposing `register(subparsers)` and setting
# `func(args) -> int` on the parsers it adds (commands/ holds those whose work lives in lower floors). Library code never parses arguments or prints.
COMMAND_MODULES = (
    "qvl.launchers.info",  # version, doctor
    "qvl.launchers.demo",  # demo
    "qvl.launchers.commands.data",  # data prepare | stats
    "qvl.launchers.commands.convert",  # convert import | export | verify | export-adapter
    "qvl.launchers.commands.recipes",  # recipes, plan, train
    "qvl.launchers.commands.launch",  # launch
    "qvl.launchers.commands.verify_training",  # verify-training
)


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
    return parser


class StderrNow(logging.StreamHandler):
    """A handler that writes to `sys.stderr` as it is when a record comes (as `logging.lastResort` does), not as it
    was when the handler was made: a command run in a process whose stderr is redirected for a while (a notebook
    cell, `nemo qvl` imported by a caller) logs where its other output goes, never into a stream since closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr


def quiet_logging(verbose: bool) -> None:
    """qvl's own logs at INFO; Megatron's INFO chatter, import probes and fallback warnings only when verbose.

    `qvl` and `nemo qvl` both call this, so the two command lines print the same. It configures the process's
    logging and warnings: only command-line entry points call it (`qvl`'s main() undoes the warning filters
    when it returns; `nemo qvl`'s process is the command)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        handlers=[StderrNow()],
    )
    logging.getLogger("qvl").setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        return
    # megatron-bridge 0.6.2's import_utils sets its logger to INFO (on import, so after this) with its own
    # handler, and logs a full traceback for every optional symbol it probes (e.g. TE's FP8GlobalStateManager).
    # A filter outlives that setLevel; verbose keeps the tracebacks.
    logging.getLogger("megatron.bridge.utils.import_utils").addFilter(_warnings_and_above)
    # torch warns once per process that a CPU-only machine has no CUDA runtime for C++ extensions.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # SyntaxWarning: megatron-core 0.19.2's sources have invalid escapes in docstrings, which Python 3.12 reports
    # as it compiles a module without bytecode yet (a process's first import after installing).
    for category in (UserWarning, FutureWarning, DeprecationWarning, SyntaxWarning):
        warnings.filterwarnings("ignore", category=category)


def _warnings_and_above(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qvl` console script: bad input ends in one `error:` line and exit status 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may also come after options (`qvl train R --model tiny k=v`); argparse stops
    # collecting positionals at the first option and cannot intermix them with subcommands.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        # The warning filters quiet_logging sets hold for this command only (main() is also called in-process).
        with warnings.catch_warnings():
            quiet_logging(args.verbose)
            return int(args.func(args) or 0)
    except QvlError as err:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
