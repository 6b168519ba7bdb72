"""A training job stopped after a step, as its checkpoints folder would hold it: for resume tests."""

from __future__ import annotations

import shutil
from pathlib import Path


def copy_step(checkpoints: Path, into: Path, *, step: int) -> None:
    """A checkpoints folder holding `step` alone: its model/optimizer folder, its dataloader state, its trackers."""
    name = f"iter_{step:07d}"
    shutil.copytree(checkpoints / name, into / name)
    shutil.copytree(checkpoints / "energon" / name, into / "energon" / name)
    shutil.copy(checkpoints / name / "train_state.pt", into / "latest_train_state.pt")
    (into / "latest_checkpointed_iteration.txt").write_text(str(step))
