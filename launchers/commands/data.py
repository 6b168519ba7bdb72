"""`qvl data prepare | stats`: build a packed Energon dataset from conversations, and inspect one."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
from collections.abc import Callable, Iterator

from qvl.data.vision import FAMILIES


def register(subparsers) -> None:
    """Add the `data` command group to the `qvl` parser."""
    data = subparsers.add_parser("data", help="conversations -> validated, token-counted, packed Energon dataset")
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    _add_prepare(commands)
    _add_stats(commands)
    data.set_defaults(func=lambda args: (data.print_help(), 0)[1])


def _add_prepare(commands) -> None:
    p = commands.add_parser("prepare", help="ingest, validate, count, pack and write an Energon dataset")
    p.add_argument("--input", type=pathlib.Path, required=True, help="LLaVA/ShareGPT or OpenAI-messages JSON/JSONL")
    p.add_argument("--media-root", type=pathlib.Path, required=True, help="directory the media paths are relative to")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--tokenizer", type=pathlib.Path, required=True, help="HF dir with tokenizer and processor configs")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per packed sequence")
    p.add_argument("--output", type=pathlib.Path, required=True)
    p.add_argument("--system-prompt", help="system prompt for samples that have none")
    p.add_argument("--chat-template", type=pathlib.Path, help="Jinja chat template replacing the tokenizer's")
    for name in ("min-pixels", "max-pixels", "video-min-pixels", "video-max-pixels"):
        p.add_argument(f"--{name}", type=int, help=f"override the processor config's {name.replace('-', '_')}")
    p.add_argument("--truncate", action="store_true", help="truncate over-long samples instead of quarantining them")
    p.add_argument("--balance-cost", action="store_true", help="even out packs' attention cost (same token fill)")
    p.add_argument("--data-parallel", type=int, help="schedule packs over D data-parallel ranks by compute cost")
    p.add_argument("--global-batch", type=int, help="packs per optimizer step over all ranks (with --data-parallel)")
    p.add_argument(
        "--model-config",
        type=pathlib.Path,
        help="HF config.json (or its dir) for the DP plan's cost model; default: the --tokenizer dir",
    )
    p.add_argument("--no-decode-check", action="store_true", help="read image headers only; skip the full decode")
    p.add_argument("--packs-per-shard", type=int, default=256)
    p.add_argument("--strict", action="store_true", help="exit 1 if any sample is quarantined")
    p.set_defaults(func=run_prepare)


def _add_stats(commands) -> None:
    p = commands.add_parser("stats", help="show a prepared dataset's report")
    p.add_argument("output", type=pathlib.Path, help="the --output of `qvl data prepare`")
    p.add_argument("--plot", type=pathlib.Path, help="write a PNG of sample lengths and pack fill")
    p.set_defaults(func=run_stats)


def run_prepare(args: argparse.Namespace) -> int:
    """`qvl data prepare`."""
    from rich.console import Console

    from qvl.data.prepare import PrepareConfig, prepare

    console = Console(stderr=True)
    config = PrepareConfig(
        input=args.input,
        media_root=args.media_root,
        family=args.family,
        tokenizer=args.tokenizer,
        seq_length=args.seq_length,
        output=args.output,
        system_prompt=args.system_prompt,
        chat_template=args.chat_template,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        video_min_pixels=args.video_min_pixels,
        video_max_pixels=args.video_max_pixels,
        truncate=args.truncate,
        balance_cost=args.balance_cost,
        decode_images=not args.no_decode_check,
        packs_per_shard=args.packs_per_shard,
        data_parallel=args.data_parallel,
        global_batch=args.global_batch,
        model_config=args.model_config,
    )
    for path, flag in ((args.input, "--input"), (args.media_root, "--media-root"), (args.tokenizer, "--tokenizer")):
        if not path.exists():
            console.print(f"[red]error:[/] {flag} {path} does not exist")
            return 2
    try:
        report = prepare(config, progress=_rich_progress(console))
    except (ValueError, OSError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    _print_report(report)
    if args.strict and report["quarantined"]:
        console.print(
            f"[red]--strict: {report['quarantined']} sample(s) quarantined; see {args.output}/quarantine.jsonl"
        )
        return 1
    return 0


def run_stats(args: argparse.Namespace) -> int:
    """`qvl data stats`."""
    from qvl.data.stats import load_report, plot_lengths_and_fill

    try:
        report = load_report(args.output)
        _print_report(report)
        if args.plot:
            print(f"plot written to {plot_lengths_and_fill(args.output, args.plot)}")
    except (FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from qvl.data.stats import report_rows

    table = Table(title="qvl data report", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report_rows(report):
        table.add_row(name, value)
    Console().print(table)


def _rich_progress(console) -> Callable:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def stage(name: str, total: int | None) -> Iterator[Callable[[int], None]]:
        columns = (TextColumn(f"{name:>8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(name, total=total)
            yield lambda n=1: progress.advance(task, n)

    return stage
