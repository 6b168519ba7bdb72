"""Write: packed samples as WebDataset tar shards with Energon's `.nv-meta`, atomically and resumably.

Everything is built in `OUT.partial/`; a shard is written under a temporary name and renamed when complete, so
a rerun with the same plan (same fingerprint) keeps finished shards and writes only the rest. Only when every
shard, the Energon index and the reports exist is `OUT.partial` renamed to `OUT`: an interrupted run never
leaves a directory that Energon would load. Tar headers are fixed (mtime 0, root owner), so a rebuild is
byte-identical.

One tar sample is one pack: `<key>.json` (source indices, lengths, grids, media names), `<key>.ids.npy` and
`<key>.loss.npy` (the expanded token ids and assistant mask of all sub-samples, concatenated), and the media as
their original encoded bytes: `<key>.img<j>.<ext>`, `<key>.vid<j>.<ext>` or `<key>.vid<j>_<f>.<ext>` (frames).
A preference pack holds pairs: each pair's chosen and rejected sub-samples adjacent (chosen first), listed in the
json's `pairs` ([[chosen_sub, rejected_sub], ...]); the rejected side's media name the chosen side's members, so a
pair's media bytes are stored once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pathlib
import shutil
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from qvl.data.chunks import SampleReader
from qvl.data.count import TokenizedSample
from qvl.data.pack import PackPlan

logger = logging.getLogger(__name__)

FINGERPRINT_FILE = ".qvl-fingerprint"
# Energon's own tools (`energon info`, `energon lint`, DefaultTaskEncoder) need a sample type: dataset.yaml names
# Energon's InterleavedSample and a loader that imports nothing of qvl (data/energon_sample_loader.py, copied
# next to it). qvl's task encoder cooks the raw tar members instead, through the crude config CRUDE_CONFIG, which
# qvl's loader names explicitly (https://nvidia.github.io/Megatron-Energon/advanced/crude_datasets.html).
DATASET_YAML = """\
sample_type:
  __module__: megatron.energon
  __class__: InterleavedSample
sample_loader: sample_loader.py:sample_loader
part_filter: sample_loader.py:part_filter
"""
CRUDE_CONFIG = "dataset_qvl.yaml"
CRUDE_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
SAMPLE_LOADER = pathlib.Path(__file__).with_name("energon_sample_loader.py")
# `energon lint` checks train, val and test and refuses a split.yaml that does not name each; val and test are empty.
SPLITS = [("train", 1.0), ("val", 0.0), ("test", 0.0)]


@dataclass(kw_only=True, slots=True)
class WriteConfig:
    """Where and how shards are written."""

    output: pathlib.Path
    family: str
    pad_ids: tuple[int, int]  # (<|image_pad|>, <|video_pad|>) ids, to expand compact tokens
    packs_per_shard: int = 256
    pairs: bool = False  # a pack's samples are preference pairs, (chosen, rejected) after one another


def partial_dir(output: pathlib.Path) -> pathlib.Path:
    """The working directory of an unfinished build of `output`."""
    output = pathlib.Path(output)
    return output.with_name(output.name + ".partial")


def start_partial(output: pathlib.Path, fingerprint: str) -> pathlib.Path:
    """Create (or resume, if the fingerprint matches) the partial directory of `output`."""
    work = partial_dir(output)
    stamp = work / FINGERPRINT_FILE
    if work.exists() and (not stamp.is_file() or stamp.read_text() != fingerprint):
        logger.info("discarding %s: it was built from a different input or plan", work)
        shutil.rmtree(work)
    if work.exists():
        logger.info("resuming %s", work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)
    return work


def shard_name(shard: int) -> str:
    return f"shard-{shard:06d}.tar"


def shard_of_pack(pack: int, packs_per_shard: int) -> int:
    return pack // packs_per_shard


def write_shards(
    work: pathlib.Path,
    plan: PackPlan,
    samples: Sequence[TokenizedSample],
    config: WriteConfig,
    on_pack: Callable[[int], None] | None = None,
) -> list[str]:
    """Write every shard of `plan` not already complete in `work`, in this process; return all shard names.

    `samples[i]` is the sample at item position i of the plan.
    """
    names = []
    for shard, packs in enumerate(shard_packs(plan.n_packs, config.packs_per_shard)):
        names.append(shard_name(shard))
        if not (work / shard_name(shard)).is_file():
            write_shard(work, shard, ((k, [samples[i] for i in plan.pack(k)]) for k in packs), config)
        if on_pack:
            on_pack(len(packs))
    return names


MAX_PACKS_PER_SHARD = 256
SPREAD_SHARDS = 64  # a small dataset is cut into about this many shards, so that every worker has some to write
MIN_PACKS_PER_SHARD = 16


def auto_packs_per_shard(n_packs: int) -> int:
    """Packs per shard when none is asked for: 256, or fewer for a dataset of under 64 such shards, so that its
    writing (and Energon's indexing) spreads over the workers; a function of the pack count alone, so every worker pool
    writes the same shards."""
    return max(MIN_PACKS_PER_SHARD, min(MAX_PACKS_PER_SHARD, -(-n_packs // SPREAD_SHARDS)))


def shard_packs(n_packs: int, packs_per_shard: int) -> list[range]:
    """The packs of each shard, in order."""
    return [range(first, min(first + packs_per_shard, n_packs)) for first in range(0, n_packs, packs_per_shard)]


def write_shard(
    work: pathlib.Path, shard: int, packs: Iterable[tuple[int, list[TokenizedSample]]], config: WriteConfig
) -> str:
    """Write one shard from (pack id, its samples) under a temporary name, then rename it into place."""
    path = pathlib.Path(work) / shard_name(shard)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for pack, subs in packs:
            for member, payload in pack_members(pack, subs, config):
                _add_member(tar, member, payload)
        tar.close()
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    return path.name


def write_shard_from_spill(work: pathlib.Path, shard: int, packs: list[tuple[int, list]], config: WriteConfig) -> int:
    """Write one shard whose samples are spilled chunks: `packs` is [(pack id, [(chunk, offset, size), ...])]."""
    path = pathlib.Path(work) / shard_name(shard)
    if not path.is_file():
        reader = SampleReader(work)
        try:
            items = ((k, [s for where in subs for s in reader.read(*where)]) for k, subs in packs)
            write_shard(work, shard, items, config)
        finally:
            reader.close()
    return len(packs)


def _add_member(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mode = 0o644
    info.mtime = 0  # fixed headers: a rebuild is byte-identical
    tar.addfile(info, io.BytesIO(payload))


def pack_members(pack: int, subs: list[TokenizedSample], config: WriteConfig) -> Iterator[tuple[str, bytes]]:
    """The tar members (name, bytes) of one pack."""
    key = f"{pack:09d}"
    ids, loss, meta_subs, media_members = [], [], [], []
    for position, sub in enumerate(subs):
        sub_ids, sub_loss = sub.expand(config.pad_ids)
        ids.append(sub_ids)
        loss.append(sub_loss)
        # A pair's rejected side (odd position) names its chosen side's media members instead of adding its own.
        shared = meta_subs[-1]["media"] if config.pairs and position % 2 else None
        meta_subs.append(_sub_meta(sub, len(sub_ids), media_members, shared))
    meta = {
        "pack": pack,
        "family": config.family,
        "samples": [s.index for s in subs],
        "lengths": [int(len(i)) for i in ids],
        "subs": meta_subs,
    }
    if config.pairs:
        meta["pairs"] = [[k, k + 1] for k in range(0, len(subs), 2)]
    yield f"{key}.json", json.dumps(meta, separators=(",", ":")).encode()
    yield f"{key}.ids.npy", _npy(np.concatenate(ids).astype(np.int32))
    yield f"{key}.loss.npy", _npy(np.concatenate(loss).astype(np.uint8))
    for member, path in media_members:
        yield f"{key}.{member}", path.read_bytes()


def _sub_meta(sub: TokenizedSample, length: int, media_members: list, shared: list[dict] | None = None) -> dict:
    return {
        "index": sub.index,
        "length": length,
        "image_grid_thw": [list(g) for g in sub.image_grids],
        "video_grid_thw": [list(g) for g in sub.video_grids],
        "second_per_grid_ts": sub.video_second_per_grid,
        "media": _media_meta(sub, media_members) if shared is None else shared,
    }


def _media_meta(sub: TokenizedSample, media_members: list) -> list[dict]:
    """The sub-sample's media entries; its files join `media_members` as (member name, path)."""
    media = []
    for info in sub.media:
        j = len(media_members)
        if info.kind == "image":
            name = f"img{j}{_ext(info.path)}"
            media_members.append((name, info.path))
            media.append({"kind": "image", "member": name})
        elif info.frame_paths:
            names = [f"vid{j}_{f:04d}{_ext(p)}" for f, p in enumerate(info.frame_paths)]
            media_members.extend(zip(names, info.frame_paths, strict=True))
            media.append({"kind": "frames", "members": names, "fps": info.fps})
        else:
            name = f"vid{j}{_ext(info.path)}"
            media_members.append((name, info.path))
            media.append({"kind": "video", "member": name, "frame_indices": info.frame_indices, "fps": info.fps})
    return media


def _ext(path: pathlib.Path) -> str:
    # Member names are "<key>.<field>": a dot inside the field would split it, so only the last suffix is kept.
    return path.suffix.lower() if path.suffix else ".bin"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_energon_meta(work: pathlib.Path, shard_names: list[str], workers: int = 1) -> None:
    """Index the shards with Energon (`.nv-meta`: index, .info.json, split.yaml), in `workers` processes of its
    own, and add the typed dataset.yaml (with its sample_loader.py) and qvl's crude config."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):  # energon prints progress; keep library output in logging
        BaseWebdatasetFactory.prepare_dataset(
            work, shard_names, split_parts_ratio=SPLITS, shuffle_seed=None, workers=workers
        )
    logger.debug("energon prepare: %s", captured.getvalue().strip())
    meta = work / ".nv-meta"
    (meta / "dataset.yaml").write_text(DATASET_YAML)
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER.read_text())
    (meta / CRUDE_CONFIG).write_text(CRUDE_YAML)


def commit(work: pathlib.Path, output: pathlib.Path) -> None:
    """Atomically replace `output` by the finished `work` directory."""
    output = pathlib.Path(output)
    (work / FINGERPRINT_FILE).unlink(missing_ok=True)
    old = output.with_name(output.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if output.exists():
        os.replace(output, old)
    os.replace(work, output)
    if old.exists():
        shutil.rmtree(old)
