"""`qvl version` and `qvl doctor`."""

from __future__ import annotations

from qvl.launchers.info import run_doctor, run_version


def register(subparsers) -> None:
    """Add `qvl version` and `qvl doctor`."""
    version = subparsers.add_parser("version", help="print qvl and stack versions, Transformer Engine and CUDA")
    version.set_defaults(func=run_version)
    doctor = subparsers.add_parser("doctor", help="check the environment and say how to fix what is missing")
    doctor.set_defaults(func=run_doctor)
