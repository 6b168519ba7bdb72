"""`qvl verify-training`'s loss picture goes beside its report (or into the run folder), never into the current folder
unasked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from qvl.launchers.commands.verify_training import PLOT_NAME, _plot_path, register


def parsed(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["verify-training", "hf", "--data", "data", *args])


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--report", "out/parity.json"), Path("out") / PLOT_NAME),
        (("--report", "out/parity.json", "--run-dir", "runs"), Path("out") / PLOT_NAME),
        (("--run-dir", "runs"), Path("runs") / PLOT_NAME),
        (("--plot", "curves.png", "--report", "out/parity.json"), Path("curves.png")),
        ((), None),
    ],
)
def test_the_picture_goes_beside_the_report(args, expected):
    assert _plot_path(parsed(*args)) == expected


def test_without_matplotlib_the_report_is_written_and_no_picture_is_drawn(tmp_path, monkeypatch, capsys):
    """matplotlib is an optional package (the `test` extra; GPU images lack it): the check's figures are kept."""
    import importlib.util
    import json
    from types import SimpleNamespace

    from qvl.launchers.commands import verify_training
    from qvl.training.parity import run as parity_run

    report = SimpleNamespace(ok=True, as_dict=lambda: {"ok": True, "steps": []})
    monkeypatch.setattr(parity_run, "run_parity", lambda spec: report)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    args = parsed("--report", str(tmp_path / "parity.json"), "--run-dir", str(tmp_path / "run"), "--json")
    assert verify_training.run_verify_training(args) == 0
    assert json.loads((tmp_path / "parity.json").read_text()) == {"ok": True, "steps": []}
    assert not (tmp_path / PLOT_NAME).exists() and json.loads(capsys.readouterr().out)["ok"]
    assert "matplotlib is not installed" in verify_training._plot_line(tmp_path / PLOT_NAME, None)
