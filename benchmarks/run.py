"""Run qvl's benchmarks: `python -m benchmarks.run [--quick] [--only NAME] [--out .bench]` (what `make bench` runs).

Every `benchmarks/bench_<name>.py` exposing `run(out_dir, quick=False) -> dict` is a benchmark. Each writes
`bench_<name>.json` into the output folder; this runner adds `summary.json` and prints one table per
benchmark. A benchmark that reports `checks` (a list of {figure, value, goal, met}) gets them in its table
with pass/fail; otherwise its scalar figures are shown, and its `goals` as unchecked. A benchmark that raises is
reported with its traceback and the others still run; the exit code is 1 if any raised. A missed goal is
a result, not a failure: it shows as FAIL in the table and in summary.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pathlib
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

BENCH_DIR = pathlib.Path(__file__).resolve().parent
PREFIX = "bench_"
MAX_FALLBACK_ROWS = 14


@dataclass(kw_only=True, slots=True)
class Outcome:
    """One benchmark's run: its results, or the error that stopped it."""

    name: str
    ok: bool
    seconds: float
    json_file: str | None
    goal_met: bool | None
    checks: list[dict]
    error: str | None


def standalone(module_doc: str, run_fn, show=None) -> None:
    """The command line of one benchmark run on its own (`python -m benchmarks.bench_NAME [--out D] [--quick]`):
    runs it and shows its results with `show` (default: the JSON)."""
    parser = argparse.ArgumentParser(description=module_doc.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = run_fn(args.out, quick=args.quick)
    (show or (lambda r: print(json.dumps(r, indent=2))))(results)


def discover() -> list[str]:
    """Names of the benchmarks in this folder (`bench_data.py` -> "data"), sorted."""
    return sorted(path.stem.removeprefix(PREFIX) for path in BENCH_DIR.glob(f"{PREFIX}*.py"))


def run_benchmark(name: str, out_dir: pathlib.Path, *, quick: bool) -> tuple[Outcome, dict | None]:
    """Import and run one benchmark; a raised error becomes a failed Outcome carrying its traceback."""
    json_path = out_dir / f"{PREFIX}{name}.json"
    json_path.unlink(missing_ok=True)  # a failed run must not leave the last run's figures looking current
    started = time.perf_counter()
    try:
        module = importlib.import_module(f"benchmarks.{PREFIX}{name}")
        results = module.run(out_dir, quick=quick)
        if not isinstance(results, dict):
            raise TypeError(f"benchmarks.{PREFIX}{name}.run returned {type(results).__name__}, not a dict of results")
    # Any error in one benchmark is reported in full (traceback in the table and summary.json) and the
    # remaining benchmarks still run; the exit code carries the failure.
    except Exception:  # noqa: BLE001
        return Outcome(
            name=name,
            ok=False,
            seconds=round(time.perf_counter() - started, 2),
            json_file=None,
            goal_met=None,
            checks=[],
            error=traceback.format_exc(),
        ), None
    if not json_path.exists():  # the convention is that each bench writes its own JSON; make sure it is there
        json_path.write_text(json.dumps(results, indent=2, default=str))
    checks = list(results.get("checks", []))
    goal_met = results.get("goal_met")
    if goal_met is None and checks and all(c.get("met") is not None for c in checks):
        goal_met = all(c["met"] for c in checks)
    outcome = Outcome(
        name=name,
        ok=True,
        seconds=round(time.perf_counter() - started, 2),
        json_file=json_path.name,
        goal_met=goal_met,
        checks=checks,
        error=None,
    )
    return outcome, results


def figures_table(outcome: Outcome, results: dict | None) -> Table:
    """The table printed for one benchmark: its checks, or else its scalar figures and goals."""
    status = (
        "ERROR"
        if not outcome.ok
        else {True: "goals met", False: "goal missed", None: "no goal checks"}[outcome.goal_met]
    )
    table = Table(title=f"{outcome.name}: {status} ({outcome.seconds:.0f} s)", title_justify="left")
    for column in ("figure", "value", "goal", "met"):
        table.add_column(column, overflow="fold")
    if not outcome.ok:
        table.add_row("error", outcome.error.strip().splitlines()[-1], "", "[red]FAIL")
        return table
    for check in outcome.checks:
        met = {True: "[green]PASS", False: "[red]FAIL", None: ""}[check.get("met")]
        table.add_row(str(check["figure"]), str(check["value"]), str(check.get("goal", "")), met)
    if not outcome.checks:
        goals = results.get("goals", {})
        rows = list(scalar_figures({k: v for k, v in results.items() if k not in ("goals", "quick")}))
        for path, value in rows[:MAX_FALLBACK_ROWS]:
            table.add_row(path, str(value), str(goals.get(path.rsplit(".", 1)[-1], "")), "")
        for goal, value in goals.items():
            table.add_row(f"goal {goal}", "", str(value), "unchecked")
    if results.get("why"):
        table.caption = f"why: {results['why']}"
    return table


def scalar_figures(results: dict, prefix: str = ""):
    """(dotted path, value) for every number, string or bool in nested dicts; lists are left to the JSON."""
    for key, value in results.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalar_figures(value, f"{path}.")
        elif isinstance(value, (int, float, str, bool)):
            yield path, value
        elif isinstance(value, list):
            yield path, f"{len(value)} rows (see JSON)"


def run_all(names: list[str], out_dir: pathlib.Path, *, quick: bool, console: Console | None = None) -> list[Outcome]:
    """Run the named benchmarks in order, print a table after each, write summary.json; returns the outcomes."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)  # logs and CI: no 80-column wrap
    out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    outcomes = []
    for name in names:
        console.print(f"running {name}{' (quick)' if quick else ''} ...")
        outcome, results = run_benchmark(name, out_dir, quick=quick)
        outcomes.append(outcome)
        console.print(figures_table(outcome, results))
        if outcome.error:
            console.print(outcome.error, markup=False, highlight=False)
    summary = {
        "started": started,
        "quick": quick,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "ok": all(o.ok for o in outcomes),
        "benchmarks": {o.name: asdict(o) for o in outcomes},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"wrote {out_dir / 'summary.json'}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """The command line: run the benchmarks asked for; 1 if any raised, else 0."""
    available = discover()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests (each bench < ~90 s)")
    parser.add_argument(
        "--only",
        action="append",
        choices=available,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(available)}",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"), help="output folder")
    args = parser.parse_args(argv)
    outcomes = run_all(args.only or available, args.out, quick=args.quick)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
