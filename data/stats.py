"""Stats: read a prepared dataset's report and packs back, as table rows and a length / fill plot."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def load_report(output: pathlib.Path) -> dict:
    """The report.json of a prepared dataset."""
    path = pathlib.Path(output) / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `qvl data prepare --output {output}` first")
    return json.loads(path.read_text())


def load_packs(output: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(per-sample token lengths, per-pack token fill) from packs.jsonl."""
    lengths, fills = [], []
    with (pathlib.Path(output) / "packs.jsonl").open() as f:
        for line in f:
            pack = json.loads(line)
            lengths.extend(pack["lengths"])
            fills.append(sum(pack["lengths"]))
    return np.asarray(lengths, dtype=np.int64), np.asarray(fills, dtype=np.int64)


def report_rows(report: dict) -> list[tuple[str, str]]:
    """The report as (name, value) rows for a table."""
    rows = [
        ("family", report["family"]),
        ("seq_length", f"{report['seq_length']:,}"),
        ("kind", report.get("kind", "sft")),  # datasets written before preference pairs are SFT
        ("read", f"{report['read']:,}"),
        ("accepted", f"{report['accepted']:,}" + (" pairs" if "pairs" in report else "")),
        ("quarantined", f"{report['quarantined']:,}"),
    ]
    rows += [(f"  {reason}", f"{count:,}") for reason, count in report["quarantined_by_reason"].items()]
    rows += [
        ("truncated", f"{report.get('truncated', 0):,}"),
        ("total tokens", f"{report['total_tokens']:,}" + (" (both sides)" if "pairs" in report else "")),
        ("packed sequences", f"{report['packed_sequences']:,}"),
        ("shards", f"{report.get('shards', 0):,}"),
        ("packing efficiency", f"{100 * report['packing_efficiency']:.2f}%"),
    ]
    if plan := report.get("dp_plan"):
        rows += [
            (
                "DP plan",
                f"{plan['data_parallel']} ranks x {plan['packs_per_rank_per_step']} packs, {plan['steps']:,} steps",
            ),
            ("  max/mean rank cost (qvl)", f"{plan['qvl']['mean_max_over_mean']:.4f}"),
            ("  max/mean rank cost (round-robin)", f"{plan['round_robin']['mean_max_over_mean']:.4f}"),
            ("  unscheduled packs", f"{plan['unscheduled_packs']:,}"),
        ]
    rows += [(f"time {stage}", f"{seconds:.2f} s") for stage, seconds in report["time_s"].items()]
    return rows


def plot_lengths_and_fill(output: pathlib.Path, png: pathlib.Path) -> pathlib.Path:
    """PNG with the sample-length histogram and the pack-fill histogram of a prepared dataset."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("the plot needs matplotlib; install it with `pip install matplotlib`") from err
    report = load_report(output)
    lengths, fills = load_packs(output)
    seq_length = report["seq_length"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist(lengths, bins=min(100, max(10, len(np.unique(lengths)))), color="tab:blue")
    left.set(title=f"sample length ({len(lengths):,} samples)", xlabel="tokens", ylabel="samples")
    right.hist(fills / seq_length * 100, bins=50, range=(0, 100), color="tab:green")
    right.set(
        title=f"pack fill (efficiency {100 * report['packing_efficiency']:.2f}%)",
        xlabel="% of seq_length",
        ylabel="packs",
    )
    figure.tight_layout()
    png = pathlib.Path(png)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return png
