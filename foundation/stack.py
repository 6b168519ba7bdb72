"""The pinned Megatron stack, read from the one place a version is written: the requirement files that `make venv`
installs and the package ships (launchers/requirements-stack.txt, requirements-nodeps.txt).

They are data beside the launchers' code, read by path (no launcher module is imported): the patch registry takes
the version each entry was written against from here (qvl.foundation.patches), and `qvl doctor` compares the
installed packages with the same lines.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from qvl.foundation.errors import QvlError

STACK_FILES = ("requirements-stack.txt", "requirements-nodeps.txt")
GPU_FILE = "requirements-gpu.txt"  # kernel packages only a GPU machine installs (flash-linear-attention)
# qvl.launchers' folder: launchers/ in a checkout, qvl/launchers in an installed wheel (package-data)
REQUIREMENTS_DIR = Path(__file__).resolve().parents[1] / "launchers"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)")


class UnpinnedPackage(QvlError, KeyError):
    """A distribution the requirement files do not pin to one version."""


def requirement_lines(files: tuple[str, ...] = STACK_FILES) -> list[str]:
    """Every requirement of the stack files (or `files`), comments and blank lines left out."""
    lines = []
    for name in files:
        for line in (REQUIREMENTS_DIR / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def normalized(distribution: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


@functools.cache
def pins() -> dict[str, str]:
    """Distribution (normalised) -> version, for every `name==version` line of the stack files."""
    return {normalized(m[1]): m[2] for line in requirement_lines() if (m := _PIN.match(line))}


@functools.cache
def gpu_pins() -> dict[str, str]:
    """Distribution (normalised) -> version, for the kernel packages only a GPU machine installs (GPU_FILE)."""
    return {normalized(m[1]): m[2] for line in requirement_lines((GPU_FILE,)) if (m := _PIN.match(line))}


def gpu_only(distribution: str) -> bool:
    """Whether `distribution` is pinned for GPU machines only (not installed by `make venv`)."""
    return normalized(distribution) in gpu_pins()


def pinned(distribution: str) -> str:
    """ "distribution version" as the stack files (or the GPU file) pin it, e.g. "megatron-core 0.19.2"."""
    version = pins().get(normalized(distribution)) or gpu_pins().get(normalized(distribution))
    if version is None:
        raise UnpinnedPackage(
            f"{distribution} is not pinned with == in {', '.join(STACK_FILES)} ({REQUIREMENTS_DIR}); pin it there"
        )
    return f"{distribution} {version}"
