"""`qvl version` and `qvl doctor`: what is installed, and what is missing with the command that fixes it."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import sys
from dataclasses import dataclass

from packaging.requirements import Requirement

from qvl.foundation.errors import ConfigError
from qvl.foundation.megatron import have_transformer_engine, import_megatron_bridge
from qvl.foundation.stack import GPU_FILE, STACK_FILES, requirement_lines
from qvl.kernels.switch import DEVICES
from qvl.launchers.upstream_report import run_patches

# Distribution names shown by `qvl version`, in stack order.
VERSION_PACKAGES = ("qvl", "torch", "megatron-core", "megatron-bridge", "transformers", "megatron-energon", "nemo-run")
REQUIRED_PYTHON = (3, 12)
# Import checks: (module, why qvl needs it). megatron.bridge goes through the runtime's TE stand-in.
IMPORT_CHECKS = (
    ("megatron.core", "model code, parallelism, checkpoints"),
    ("megatron.bridge", "bridges, ConfigContainer, the training loop"),
    ("megatron.energon", "the packed dataset loader"),
    ("nemo_run", "launching on local, Slurm and Kubernetes executors"),
)


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def stack_requirements(files: tuple[str, ...] = STACK_FILES) -> list[Requirement]:
    """The pinned stack (or `files`) from the requirement files shipped inside qvl.launchers (the one place they
    live)."""
    return [Requirement(line) for line in requirement_lines(files)]


def cuda_summary() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no (CPU only: run with --device cpu)"
    return f"yes ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})"


def run_version(args: argparse.Namespace) -> int:
    for name in VERSION_PACKAGES:
        print(f"{name:18} {installed_version(name) or 'not installed'}")
    te = installed_version("transformer-engine") or installed_version("transformer_engine")
    print(f"{'transformer-engine':18} {te if have_transformer_engine() else 'not installed'}")
    print(f"{'cuda':18} {cuda_summary()}")
    return 0


@dataclass(kw_only=True, slots=True)
class Check:
    """One line of `qvl doctor`: what was checked, whether it passed, and the fix if not."""

    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""


def _python_check() -> Check:
    found = sys.version_info[:2]
    wanted = ".".join(map(str, REQUIRED_PYTHON))
    if found == REQUIRED_PYTHON:
        return Check(name="python", status="ok", detail=sys.version.split()[0])
    return Check(
        name="python",
        status="fail",
        detail=f"{found[0]}.{found[1]} (need {wanted})",
        fix=f"create the environment with Python {wanted}: `make venv` finds pyenv's {wanted}",
    )


def _requirement_check(req: Requirement) -> Check:
    found = installed_version(req.name)
    nodeps = " --no-deps" if req.name == "megatron-bridge" else ""
    fix = f"pip install{nodeps} '{req}'"
    if found is None:
        return Check(name=req.name, status="fail", detail="not installed", fix=fix)
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        return Check(
            name=req.name,
            status="warn",
            detail=f"{found} (qvl is tested with {req.specifier})",
            fix=f"{fix}  (inside a NeMo container, keep the container's version)",
        )
    return Check(name=req.name, status="ok", detail=found)


def _gpu_requirement_check(req: Requirement, *, cuda: bool) -> Check:
    """A kernel package of GPU machines (launchers/requirements-gpu.txt): optional, at its pin where installed."""
    found = installed_version(req.name)
    fix = f"pip install '{req}'"
    if found is None:
        detail = "not installed: Qwen3.5-VL's Gated DeltaNet runs qvl's torch kernels"
        return Check(name=req.name, status="warn" if cuda else "ok", detail=detail + (" (slow)" if cuda else ""),
                     fix=fix if cuda else "")  # fmt: skip
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        return Check(name=req.name, status="warn", fix=fix,
                     detail=f"{found} (qvl's fp32 fix of its kernels is written against {req.specifier})")  # fmt: skip
    return Check(name=req.name, status="ok", detail=found)


def _import_check(module: str, why: str) -> Check:
    try:
        import_megatron_bridge() if module == "megatron.bridge" else importlib.import_module(module)
    except Exception as err:  # doctor reports every failure rather than stopping at the first
        return Check(
            name=f"import {module}",
            status="fail",
            detail=f"{type(err).__name__}: {err}",
            fix=f"needed for {why}; reinstall with `make venv` or see README, Install",
        )
    return Check(name=f"import {module}", status="ok", detail=why)


def _device_check(summary: str) -> Check:
    if summary.startswith("no"):
        return Check(name="device", status="ok", detail="CPU only: qvl's CPU runtime runs tiny models (--device cpu)")
    te = "with Transformer Engine" if have_transformer_engine() else "without Transformer Engine (local specs, SDPA)"
    return Check(name="device", status="ok", detail=f"{summary}, {te}")


def doctor_checks() -> list[Check]:
    """Every environment check, in the order a person would fix them."""
    checks = [_python_check()]
    checks += [_requirement_check(req) for req in stack_requirements()]
    summary = cuda_summary()
    cuda = not summary.startswith("no")
    checks += [_gpu_requirement_check(req, cuda=cuda) for req in stack_requirements((GPU_FILE,))]
    checks += [_import_check(module, why) for module, why in IMPORT_CHECKS]
    checks.append(_device_check(summary))
    return checks


def run_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if getattr(args, "patches", False):
        return run_patches(args)
    given = [flag for flag in ("recipe", "device", "json", "markdown") if getattr(args, flag, None)]
    if given:
        raise ConfigError(f"--{given[0]} is an option of `qvl doctor --patches`; add --patches")
    checks = doctor_checks()
    table = Table(title="qvl doctor")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for check in checks:
        table.add_row(check.name, f"[{colour[check.status]}]{check.status}[/]", check.detail, check.fix)
    Console(width=160).print(table)
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        print(f"{len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("environment ok")
    return 0


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
