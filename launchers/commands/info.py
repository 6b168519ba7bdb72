"""`qvl version` and `qvl doctor`."""

from __future__ import annotations

from qvl.kernels.switch import DEVICES
from qvl.launchers.info import run_doctor, run_version


def register(subparsers) -> None:
    """Add `qvl version` and `qvl doctor`."""
    version = subparsers.add_parser("version", help="print qvl and stack versions, Transformer Engine and CUDA")
    version.set_defaults(func=run_version)
    doctor = subparsers.add_parser("doctor", help="check the environment and say how to fix what is missing")
    doctor.add_argument(
        "--patches", action="store_true", help="list qvl's upstream changes by group and which a run uses"
    )
    doctor.add_argument("--recipe", help="with --patches: the groups this recipe's run uses (default: any model)")
    doctor.add_argument("--device", choices=DEVICES, help="with --patches: the run's device (default: this machine's)")
    doctor.add_argument("--json", action="store_true", help="with --patches: print JSON")
    doctor.add_argument("--markdown", action="store_true", help="with --patches: the table of docs/upstream.md")
    doctor.set_defaults(func=run_doctor)
