"""`qvl demo`: the whole pipeline end to end with a tiny model."""

from __future__ import annotations

from qvl.foundation.families import FAMILIES
from qvl.launchers.demo import FAMILY, run_demo


def register(subparsers) -> None:
    """Add `qvl demo`."""
    demo = subparsers.add_parser("demo", help="run the pipeline end to end with a tiny model (CPU or GPU)")
    demo.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--family", choices=list(FAMILIES), default=FAMILY, help=f"model family (default {FAMILY})")
    demo.add_argument("--output", default=".demo", help="where artifacts go (default .demo/)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (progress on stderr)")
    demo.set_defaults(func=run_demo)
