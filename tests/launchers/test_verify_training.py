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
