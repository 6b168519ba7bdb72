"""A preference dataset's reference log-probs: the table `qvl reference` writes beside the packs, and what ties it to
the dataset and the checkpoint it was computed from.

`REF/logps.npz` holds, per packed sub-sequence (one side of a pair), the pack id (`pack`, meta["pack"] of the
written pack), the sub-sequence's index in the pack (`sub`), the summed log-prob of its learned tokens under the
reference model (`logp`, float64) and their count (`tokens`). `REF/reference.json` names what it was computed from:
the dataset (its path and a fingerprint of report.json and packs.jsonl) and the checkpoint (its path, iteration and a
fingerprint of that iteration's metadata), and the layout it ran at. A training run refuses a table made from another
dataset or checkpoint (`check_reference`), so a stale reference never trains silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qvl.foundation.errors import DataError

TABLE = "logps.npz"
INFO = "reference.json"
LATEST = "latest_checkpointed_iteration.txt"  # Megatron's tracker file in a checkpoint folder


@dataclass(kw_only=True, slots=True, frozen=True)
class ReferenceSource:
    """What a reference table was computed from: a dataset and a Megatron checkpoint, each by path and fingerprint."""

    data: str
    data_fingerprint: str
    checkpoint: str
    checkpoint_fingerprint: str

    @classmethod
    def of(cls, data: str | Path, checkpoint: str | Path) -> ReferenceSource:
        """The source of a reference computed over `data` from `checkpoint` (both as they are on disk now)."""
        return cls(
            data=str(Path(data).resolve()),
            data_fingerprint=dataset_fingerprint(data),
            checkpoint=str(Path(checkpoint).resolve()),
            checkpoint_fingerprint=checkpoint_fingerprint(checkpoint),
        )


def dataset_fingerprint(path: str | Path) -> str:
    """A prepared dataset's identity: report.json and packs.jsonl hashed (what was packed, and how)."""
    digest = hashlib.sha256()
    for name in ("report.json", "packs.jsonl"):
        file = Path(path) / name
        if not file.is_file():
            raise DataError(f"data={path} has no {name}; pass a folder written by `qvl data prepare`")
        digest.update(name.encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def checkpoint_fingerprint(path: str | Path) -> str:
    """A Megatron checkpoint's identity: its latest iteration and that iteration's torch_dist metadata hashed."""
    path = Path(path)
    latest = path / LATEST
    iteration = latest.read_text().strip() if latest.is_file() else ""
    folder = path if not iteration else path / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    metadata = folder / ".metadata"
    if not metadata.is_file():
        raise DataError(
            f"pretrained_checkpoint={path} is not a Megatron checkpoint (no {LATEST} or .metadata); pass the folder "
            "`qvl convert import` or a training run wrote"
        )
    return hashlib.sha256(iteration.encode() + metadata.read_bytes()).hexdigest()[:16]


def write_reference(
    out: Path, *, pack: np.ndarray, sub: np.ndarray, logp: np.ndarray, tokens: np.ndarray, source: ReferenceSource,
    layout: dict,
) -> None:  # fmt: skip
    """Write the table and its source into `out` (the table first, the info file last: a folder with reference.json
    is complete)."""
    out.mkdir(parents=True, exist_ok=True)
    order = np.lexsort((sub, pack))
    np.savez(
        out / TABLE,
        pack=pack[order].astype(np.int64),
        sub=sub[order].astype(np.int64),
        logp=logp[order].astype(np.float64),
        tokens=tokens[order].astype(np.int64),
    )
    info = {"source": asdict(source), "layout": layout, "rows": int(len(pack))}
    (out / INFO).write_text(json.dumps(info, indent=2))


def read_source(path: str | Path) -> ReferenceSource | None:
    """The source recorded in a reference folder, or None where there is no complete reference."""
    info = Path(path) / INFO
    if not info.is_file() or not (Path(path) / TABLE).is_file():
        return None
    return ReferenceSource(**json.loads(info.read_text())["source"])


def check_reference(path: str | Path, *, data: str | Path, checkpoint: str | Path, recipe: str) -> None:
    """Refuse a missing reference, or one computed from another dataset or checkpoint, naming both and the fix."""
    compute = f"`qvl reference {recipe} data={data} pretrained_checkpoint={checkpoint}`"
    recorded = read_source(path)
    if recorded is None:
        raise DataError(f"reference={path} holds no reference log-probs yet; compute them with {compute}")
    now = ReferenceSource.of(data, checkpoint)
    if recorded.data_fingerprint != now.data_fingerprint:
        raise DataError(
            f"reference={path} was computed over data={recorded.data}, not this run's data={now.data} (another "
            f"dataset, or the same folder prepared again); compute it again with {compute}"
        )
    if recorded.checkpoint_fingerprint != now.checkpoint_fingerprint:
        raise DataError(
            f"reference={path} was computed from checkpoint {recorded.checkpoint}, not this run's "
            f"pretrained_checkpoint={now.checkpoint}; compute it again with {compute}"
        )


@dataclass(kw_only=True, slots=True)
class ReferenceTable:
    """The reference log-probs by (pack id, sub-sequence), loaded once per loader process."""

    rows: dict[int, tuple[np.ndarray, np.ndarray]]  # pack id -> (logp [subs], tokens [subs])

    @classmethod
    def load(cls, path: str | Path) -> ReferenceTable:
        """The table in reference folder `path`."""
        file = Path(path) / TABLE
        if not file.is_file():
            raise DataError(f"reference={path} has no {TABLE}; compute it with `qvl reference RECIPE ...`")
        with np.load(file) as table:
            order = np.lexsort((table["sub"], table["pack"]))  # rows grouped by pack, whatever order they were kept in
            pack, sub, logp, tokens = (table[k][order] for k in ("pack", "sub", "logp", "tokens"))
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        starts = np.flatnonzero(np.r_[True, pack[1:] != pack[:-1]]) if len(pack) else np.zeros(0, np.int64)
        for start, end in zip(starts, np.r_[starts[1:], len(pack)]):
            rows[int(pack[start])] = (logp[start:end], tokens[start:end])
        return cls(rows=rows)

    def for_pack(self, pack: int, subs: int) -> tuple[np.ndarray, np.ndarray]:
        """Pack `pack`'s reference (logp, tokens) per sub-sequence; one clear error where the table lacks it."""
        found = self.rows.get(int(pack))
        if found is None or len(found[0]) != subs:
            raise DataError(
                f"the reference table has no log-probs for pack {pack} ({subs} sub-sequences); it was computed over "
                "another dataset: compute it again with `qvl reference RECIPE ...`"
            )
        return found
