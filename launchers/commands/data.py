"""`qvl data prepare | stats`: build a packed Energon dataset from conversations, and inspect one."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator

from qvl.data.parallel import RayConfig
from qvl.data.preference import KINDS
from qvl.data.prepare import PrepareConfig, prepare
from qvl.data.stats import load_report, plot_lengths_and_fill, report_rows
from qvl.data.write import partial_dir
from qvl.foundation.errors import DataError, QvlError
from qvl.foundation.families import FAMILIES
from qvl.launchers.os_errors import os_errors_as


def register(subparsers) -> None:
    """Add the `data` command group to the `qvl` parser."""
    data = subparsers.add_parser("data", help="conversations -> validated, token-counted, packed Energon dataset")
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    _add_prepare(commands)
    _add_stats(commands)
    data.set_defaults(func=lambda args: (data.print_help(), 0)[1])


def _add_prepare(commands) -> None:
    p = commands.add_parser("prepare", help="ingest, validate, count, pack and write an Energon dataset")
    p.add_argument(
        "--input",
        type=pathlib.Path,
        required=True,
        help="JSON/JSONL of conversations (LLaVA/ShareGPT, OpenAI messages) or preference pairs (TRL, RLAIF-V, "
        "ms-swift, LLaMA-Factory)",
    )
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="auto",
        help="sft: conversations; preference: chosen/rejected pairs, packed together; auto: as the first record is",
    )
    p.add_argument("--media-root", type=pathlib.Path, required=True, help="directory the media paths are relative to")
    p.add_argument("--family", choices=list(FAMILIES), required=True)
    p.add_argument(
        "--hf-path",
        "--tokenizer",  # the flag's earlier name, still accepted
        dest="hf_path",
        type=pathlib.Path,
        required=True,
        help="HF checkpoint dir with the tokenizer and processor configs (the recipes' hf_path)",
    )
    p.add_argument("--seq-length", type=int, required=True, help="tokens per packed sequence")
    p.add_argument("--output", type=pathlib.Path, required=True)
    p.add_argument("--system-prompt", help="system prompt for samples that have none")
    p.add_argument("--chat-template", type=pathlib.Path, help="Jinja chat template replacing the tokenizer's")
    p.add_argument(
        "--template-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chat-template switch, e.g. enable_thinking=false or reasoning_effort=low (repeatable)",
    )
    p.add_argument(
        "--no-reasoning-loss",
        action="store_true",
        help="read assistant reasoning blocks (<think>...</think>) without learning them; their answers are learned",
    )
    for name in ("min-pixels", "max-pixels", "video-min-pixels", "video-max-pixels"):
        p.add_argument(f"--{name}", type=int, help=f"override the processor config's {name.replace('-', '_')}")
    p.add_argument("--truncate", action="store_true", help="truncate over-long samples instead of quarantining them")
    p.add_argument(
        "--balance-cost",
        action="store_true",
        help="even out packs' forward FLOPs (LM + vision, same token fill); needs the model's config.json",
    )
    p.add_argument("--data-parallel", type=int, help="schedule packs over D data-parallel ranks by compute cost")
    p.add_argument(
        "--global-batch-size", type=int, help="packs per optimizer step over all ranks (with --data-parallel)"
    )
    p.add_argument(
        "--model-config",
        type=pathlib.Path,
        help="HF config.json (or its dir) for the DP plan's cost model; default: the --hf-path dir",
    )
    p.add_argument("--no-decode-check", action="store_true", help="read image headers only; skip the integrity check")
    p.add_argument(
        "--full-decode",
        action="store_true",
        help="decode every image's pixels instead of checking JPEG markers / PNG CRCs (slower)",
    )
    p.add_argument(
        "--packs-per-shard",
        type=_positive,
        help="packs per shard (default: 256, fewer for small datasets so that writing spreads over the workers)",
    )
    p.add_argument(
        "--workers",
        type=_positive,
        help=f"worker processes for validate, count and write (default: every core, {len(os.sched_getaffinity(0))})",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run the chunks and shards as Ray tasks: ADDRESS is 'auto' (the running cluster), host:port or "
        "ray://host:10001; without one (or 'local[:CPUS]') a cluster on this machine. Paths must be on storage "
        "every node sees",
    )
    p.add_argument("--ray-temp-dir", type=pathlib.Path, help="a local Ray cluster's session dir (default: Ray's)")
    p.add_argument("--chunk-size", type=_positive, default=1024, help="records per unit of work and of resumption")
    p.add_argument("--strict", action="store_true", help="exit 1 if any sample is quarantined")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_prepare)


def _add_stats(commands) -> None:
    p = commands.add_parser("stats", help="show a prepared dataset's report")
    p.add_argument("output", type=pathlib.Path, help="the --output of `qvl data prepare`")
    p.add_argument("--plot", type=pathlib.Path, help="write a PNG of sample lengths and pack fill")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_stats)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def template_args(pairs: list[str]) -> dict:
    """--template-arg KEY=VALUE pairs as apply_chat_template kwargs: JSON values (true, 3, "x") or plain text."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DataError(f"--template-arg {pair!r} is not KEY=VALUE; e.g. --template-arg enable_thinking=false")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def _ray_settings(args: argparse.Namespace):

    if args.ray is None:
        return None
    if args.ray == "local" or args.ray.startswith("local:"):
        cpus = args.ray.partition(":")[2]
        return RayConfig(num_cpus=int(cpus) if cpus else None, temp_dir=args.ray_temp_dir)
    return RayConfig(address=args.ray)


def run_prepare(args: argparse.Namespace) -> int:
    """`qvl data prepare`."""
    from rich.console import Console

    console = Console(stderr=True)
    config = PrepareConfig(
        input=args.input,
        media_root=args.media_root,
        family=args.family,
        hf_path=args.hf_path,
        seq_length=args.seq_length,
        output=args.output,
        kind=args.kind,
        system_prompt=args.system_prompt,
        chat_template=args.chat_template,
        template_args=template_args(args.template_arg),
        reasoning_loss=not args.no_reasoning_loss,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        video_min_pixels=args.video_min_pixels,
        video_max_pixels=args.video_max_pixels,
        truncate=args.truncate,
        balance_cost=args.balance_cost,
        decode_images=not args.no_decode_check,
        full_decode=args.full_decode,
        packs_per_shard=args.packs_per_shard,
        chunk_size=args.chunk_size,
        workers=args.workers or len(os.sched_getaffinity(0)),
        ray=_ray_settings(args),
        data_parallel=args.data_parallel,
        global_batch_size=args.global_batch_size,
        model_config=args.model_config,
    )
    for path, flag in ((args.input, "--input"), (args.media_root, "--media-root"), (args.hf_path, "--hf-path")):
        if not path.exists():
            raise DataError(f"{flag} {path} does not exist; pass an existing path")
    progress = _no_progress if args.quiet else _rich_progress(console) if console.is_terminal else _line_progress
    partial = partial_dir(config.output)
    resume = f"then run the same command again: it resumes from {partial}/"
    try:
        with os_errors_as(DataError, where=partial, then=resume):
            report = prepare(config, progress=progress)
    except QvlError:
        raise
    except (ValueError, OSError) as err:  # e.g. an unreadable input file: one line, the traceback with -v
        raise DataError(str(err)) from err
    _print_report(report)
    if args.strict and report["quarantined"]:
        console.print(
            f"[red]--strict: {report['quarantined']} sample(s) quarantined; see {args.output}/quarantine.jsonl"
        )
        return 1
    return 0


def run_stats(args: argparse.Namespace) -> int:
    """`qvl data stats`."""

    try:
        report = load_report(args.output)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
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

    if not sys.stdout.isatty():  # a pipe or a file: plain aligned columns, never wrapped or cut
        rows = report_rows(report)
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"{name.ljust(width)}  {value}")
        return
    table = Table(title="qvl data report", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report_rows(report):
        table.add_row(name, value)
    Console().print(table)


@contextlib.contextmanager
def _no_progress(name: str, total: int | None) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


def _rich_progress(console) -> Callable:
    """Progress bars with the stage's rate (items/s) and ETA, for a terminal."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    @contextlib.contextmanager
    def stage(name: str, total: int | None) -> Iterator[Callable[[int], None]]:
        rate = TextColumn("{task.fields[rate]}")
        columns = (TextColumn(f"{name:>14}"), BarColumn(), MofNCompleteColumn(), rate, TimeElapsedColumn())
        with Progress(*columns, TextColumn("ETA"), TimeRemainingColumn(), console=console) as progress:
            task = progress.add_task(name, total=total, rate="")
            start = time.perf_counter()

            def advance(n: int = 1) -> None:
                progress.advance(task, n)
                done = progress.tasks[0].completed
                progress.update(task, rate=f"{done / max(time.perf_counter() - start, 1e-9):,.0f}/s")

            yield advance

    return stage


@contextlib.contextmanager
def _line_progress(name: str, total: int | None, every_s: float = 10.0) -> Iterator[Callable[[int], None]]:
    """One line on stderr every `every_s` seconds with count, rate and ETA: for logs and pipes."""
    start = last = time.perf_counter()
    done = 0

    def line(final: bool = False) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        rate = done / elapsed
        of = f"/{total:,}" if total else ""
        eta = f", ETA {(total - done) / rate:,.0f} s" if total and rate and not final else ""
        print(f"{name}: {done:,}{of} in {elapsed:,.1f} s ({rate:,.0f}/s{eta})", file=sys.stderr, flush=True)

    def advance(n: int = 1) -> None:
        nonlocal done, last
        done += n
        if time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            line()

    yield advance
    line(final=True)
