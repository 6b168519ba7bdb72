"""Rank functions for the conversion tests: import + verify every family inside one set of processes,
so the two-process tests pay for process start-up and imports once."""

from __future__ import annotations

from pathlib import Path

from qvl.bridges import convert


def import_and_verify_all(hf_dirs: dict[str, str], out_root: str) -> dict[str, dict | None]:
    """On each rank: convert every family at the current TP/PP layout, then verify it; reports by family."""
    reports = {}
    for family, hf_dir in hf_dirs.items():
        out = Path(out_root) / family
        convert.import_checkpoint(Path(hf_dir), out, dtype="fp32")
        reports[family] = convert.verify_on_rank(hf_dir, str(out), tolerance=None, video=True)
    return reports
