"""Checks of a Megatron torch_dist checkpoint's files, before anything loads it.

A missing, half-copied or truncated checkpoint otherwise fails deep inside torch.distributed.checkpoint after
the whole model is built; these checks name the folder, the file and the fix in a second.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from qvl.foundation.errors import ConversionError

LATEST_FILE = "latest_checkpointed_iteration.txt"


def has_checkpoint(path: Path) -> bool:
    """Whether `path` holds a Megatron checkpoint to resume from (its latest-iteration file)."""
    return (Path(path) / LATEST_FILE).is_file()


def iteration_dir(path: Path, what: str) -> Path:
    """The folder of the latest iteration of the checkpoint at `path` (or `path` itself if it is one)."""
    path = Path(path)
    fix = f"pass the folder `qvl convert import` or training wrote as {what}"
    if not path.is_dir():
        raise ConversionError(f"{what}={path} does not exist or is not a folder; {fix}")
    if (path / ".metadata").is_file():
        return path
    latest = path / LATEST_FILE
    if not latest.is_file():
        raise ConversionError(f"{what}={path} is not a Megatron checkpoint (no {LATEST_FILE}); {fix}")
    text = latest.read_text().strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise ConversionError(f"{what}={path}: {LATEST_FILE} holds {text!r}, not an iteration; the copy is damaged")
    return path / f"iter_{int(text):07d}"


def check_megatron_checkpoint(path: Path, what: str = "checkpoint") -> Path:
    """Refuse a checkpoint whose latest iteration is missing, incomplete or truncated; returns that iteration's folder.

    torch_dist's `.metadata` records, for every tensor, the file, offset and length it was written to; a file
    shorter than its last recorded byte was cut off in a copy or an interrupted save."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = iteration_dir(path, what)
    if not folder.is_dir():
        raise ConversionError(f"{what}={path}: the latest iteration {folder.name} is missing; the copy is incomplete")
    if not (folder / ".metadata").is_file():
        raise ConversionError(
            f"{what}={path}: {folder.name}/.metadata is missing; the save was interrupted or the copy is incomplete"
        )
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except (EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise ConversionError(
            f"{what}={path}: {folder.name}/.metadata cannot be read ({type(err).__name__}); the file is damaged, "
            "copy or write the checkpoint again"
        ) from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = folder / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            raise ConversionError(f"{what}={path}: {folder.name}/{name} is missing; the copy is incomplete")
        if size < end:
            raise ConversionError(
                f"{what}={path}: {folder.name}/{name} is truncated ({size} of {end} bytes); copy or write the "
                "checkpoint again"
            )
    return folder


RUN_CONFIG = "run_config.yaml"


def adapter_settings(path: Path, what: str = "checkpoint") -> dict | None:
    """The `peft` section of the run_config.yaml the latest iteration at `path` was saved with: a PEFT run's
    adapters (the checkpoint then holds only those), or None for a full model."""
    import yaml

    config = iteration_dir(path, what) / RUN_CONFIG
    return (yaml.safe_load(config.read_text()) or {}).get("peft") or None if config.is_file() else None


def checkpoint_tensor_names(path: Path, what: str = "checkpoint") -> list[str]:
    """The tensor names a Megatron torch_dist checkpoint's latest iteration holds (from its `.metadata` only)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = check_megatron_checkpoint(path, what)
    return sorted(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
