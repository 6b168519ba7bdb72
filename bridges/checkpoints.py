"""Checks of a Megatron torch_dist checkpoint's files, before anything loads it, and the HF side a run keeps.

A missing, half-copied or truncated checkpoint otherwise fails deep inside torch.distributed.checkpoint after
the whole model is built; these checks name the folder, the file and the fix in a second. `keep_hf_side` copies the
pretrained checkpoint's `hf/` folder next to a run's checkpoints, so the run exports in one command.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

from qvl.foundation.errors import ConversionError
from qvl.foundation.rendezvous import rendezvous

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
# A checkpoint folder's HF side (config, tokenizer, processor, kept-aside tensors, tensor names): written by
# `qvl convert import`, kept with a run's checkpoints by `qvl train`, read by export and verify.
HF_FILES_DIR = "hf"


def has_checkpoint(path: Path) -> bool:
    """Whether `path` holds a Megatron checkpoint to resume from (its latest-iteration file)."""
    return (Path(path) / LATEST_FILE).is_file()


def checkpoints_of(path: Path) -> Path:
    """The checkpoint folder of `path`: a `qvl train` run directory's `checkpoints/`, else `path` itself."""
    path = Path(path)
    inner = path / "checkpoints"
    return inner if not has_checkpoint(path) and (inner / LATEST_FILE).is_file() else path


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


def keep_hf_side(config: Any) -> Path | None:
    """Keep the HF side files of the checkpoint a run starts from with the run's checkpoints (CHECKPOINTS/hf), so
    `qvl convert export RUN OUT` and `export-adapter` need nothing copied by hand; returns that folder, or None where
    the run has none to keep (it logs which flag gives the HF side at export). Rank 0 copies; a resumed run keeps
    what it has."""
    save = config.checkpoint.save
    if not save or rendezvous(os.environ).rank != 0:
        return None
    kept = Path(save) / HF_FILES_DIR
    if (kept / "config.json").is_file():
        return kept
    pretrained = config.checkpoint.pretrained_checkpoint
    if not pretrained:
        logger.warning(
            "this run starts from scratch (no pretrained_checkpoint), so its checkpoints keep no HF config; export "
            "it with `qvl convert export %s OUT --hf HF_DIR`, HF_DIR an HF checkpoint of its architecture",
            save,
        )
        return None
    source = Path(pretrained) / HF_FILES_DIR
    if not (source / "config.json").is_file() and not (Path(pretrained) / "config.json").is_file():
        logger.warning(
            "pretrained_checkpoint=%s has no %s/ folder (it was not written by `qvl convert import`), so this run "
            "keeps no HF side files; export it with `qvl convert export %s OUT --hf HF_DIR`, HF_DIR the HF "
            "checkpoint it was converted from", pretrained, HF_FILES_DIR, save,
        )  # fmt: skip
        return None
    kept.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hf-", dir=kept.parent))  # renamed into place whole
    if (source / "config.json").is_file():
        shutil.copytree(source, staging, dirs_exist_ok=True)
    else:  # an HF checkpoint directory itself (Megatron-Bridge loads those as pretrained_checkpoint)
        from qvl.bridges.convert import write_hf_side  # torch, safetensors

        write_hf_side(Path(pretrained), staging)
    if kept.exists():  # an empty or partial folder: filled in place
        shutil.copytree(staging, kept, dirs_exist_ok=True)
        shutil.rmtree(staging)
    else:
        staging.rename(kept)
    logger.info(
        "kept the HF side files of %s in %s (config, tokenizer, processor, kept-aside tensors)", pretrained, kept
    )
    return kept
