"""The site file that holds a team's executor settings, and what a launch prints of a config.

Command-line overrides (`tensor_parallel=4`, `train.train_iters=100`, `run.executor.nodes=2`) are parsed by the one
grammar in qvl.recipes.overrides, the same that `qvl train` uses on the execution side.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from qvl.foundation.errors import LaunchError


def missing_required(fn: Callable[..., Any], given: dict[str, Any]) -> list[str]:
    """Required keyword parameters of `fn` absent (or empty) in `given`."""
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and given.get(name) in (None, "")
    ]


def load_site_config(path: str | Path, kind: str) -> dict[str, Any]:
    """The `kind:` section (local | slurm | kubernetes) of a site YAML file; no secrets allowed in it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise LaunchError(f"--executor-config {path}: cannot read it ({err.strerror})") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise LaunchError(
            f"--executor-config {path}: not valid YAML{where} ({problem}); fix the file (e.g. `key: value`, "
            "two-space indents, no tabs)"
        ) from err
    if not isinstance(data, dict):
        raise LaunchError(
            f"--executor-config {path}: expected a mapping of executor kinds (slurm:, kubernetes:, local:)"
        )
    section = data.get(kind) or {}
    if not isinstance(section, dict):
        raise LaunchError(f"--executor-config {path}: section {kind!r} must be a mapping of factory keywords")
    _reject_secrets(section, f"{path}:{kind}")
    return dict(section)


def _reject_secrets(section: dict[str, Any], where: str) -> None:
    from qvl.launchers.executors import SECRET_NAMES, SECRET_WORDS

    for key, value in section.items():
        if key not in SECRET_NAMES and any(word in key.lower() for word in SECRET_WORDS):
            raise LaunchError(
                f"{where}: {key!r} looks like a secret; keep tokens out of the site file (use the "
                "environment, your ssh-agent or the kubeconfig)"
            )
        if isinstance(value, dict):
            _reject_secrets(value, f"{where}.{key}")


def to_plain(obj: Any, depth: int = 3) -> Any:
    """A YAML-printable view of a config (dataclasses to dicts, other objects to their repr)."""
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, (str, int, float)):  # subclasses (e.g. IntEnum-likes) print as their plain value
        return type(obj).__mro__[-2](obj)
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, depth) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v, depth) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and depth > 0:
        return {f.name: to_plain(getattr(obj, f.name, None), depth - 1) for f in dataclasses.fields(obj)}
    text = repr(obj)
    return text if len(text) <= 120 else text[:117] + "..."
