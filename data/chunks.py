"""Chunks: validate and count one chunk of records in any process, and spill the results to disk.

The input is cut by position into chunks of `chunk_size` records; chunk k holds records k*C .. k*C + C - 1.
A chunk is processed on its own (parse, canonicalise, validate, count, fit to `seq_length`) by whichever
process, worker or Ray task gets it, and leaves two files in `WORK/chunks/`:

- `chunk-<k>.bin`: the accepted items' compact tokens and media, one blob per item, back to back (an SFT item is
  one sample; a preference item is a pair, its chosen then its rejected side, qvl.data.preference);
- `chunk-<k>.npz`: per accepted item its source index, token length (both sides of a pair) and first side's
  length, blob offset/size, its vision grids (a pair's once: its sides share them; for the cost model), plus the
  chunk's rejections and counters. It is written last, by rename: a chunk whose `.npz` exists is finished, and a
  rerun skips it.

Because a chunk's files depend only on its records and the settings, 1 process, N workers and Ray give the
same files, and the driver merges them in chunk order. The driver keeps per sample only a few integers.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from qvl.data.count import TokenCounter, TokenizedSample, check_template_args, load_tokenizer, truncate
from qvl.data.ingest import IngestConfig, Rejection, parse_record, to_conversation
from qvl.data.preference import count_pairs, preference_keys, to_pair, validate_pair
from qvl.data.validate import MediaInfo, ValidateConfig, validate_sample
from qvl.data.vision import VisionConfig, load_vision_config

logger = logging.getLogger(__name__)

CHUNK_DIR = "chunks"


@dataclass(kw_only=True, slots=True, frozen=True)
class ChunkConfig:
    """What a worker needs to process any chunk; small and picklable (it travels with every task)."""

    work: pathlib.Path  # the build's working directory (shared storage when the workers are Ray nodes)
    media_root: pathlib.Path
    family: str
    tokenizer: pathlib.Path
    seq_length: int
    kind: str = "sft"  # "sft": conversations; "preference": pairs (qvl.data.preference)
    chat_template: str | None = None
    template_args: tuple[tuple[str, Any], ...] = ()  # the chat template's switches (enable_thinking, ...)
    reasoning_loss: bool = True  # assistant reasoning blocks learned with their answers
    system_prompt: str | None = None
    vision_overrides: tuple[tuple[str, int | None], ...] = ()
    truncate: bool = False
    decode_images: bool = True
    full_decode: bool = False
    count_batch_size: int = 256


@dataclass(kw_only=True, slots=True)
class _Worker:
    """The per-process state: loaded once per process and settings, reused for every chunk it processes."""

    vision: VisionConfig
    counter: TokenCounter
    validate: ValidateConfig
    ingest: IngestConfig


def warm_up(settings: ChunkConfig) -> _Worker:
    """Load what every chunk needs (tokenizer, processor settings) in this process, so forked workers start with it."""
    return _worker(settings)


@functools.lru_cache(maxsize=2)
def _worker(settings: ChunkConfig) -> _Worker:
    vision = load_vision_config(settings.tokenizer, settings.family, **dict(settings.vision_overrides))
    counter = TokenCounter(
        tokenizer=load_tokenizer(settings.tokenizer, settings.chat_template),
        vision=vision,
        template_args=settings.template_args,
        reasoning_loss=settings.reasoning_loss,
    )
    check_template_args(counter.tokenizer, settings.template_args, str(settings.tokenizer))
    validate = ValidateConfig(
        media_root=pathlib.Path(settings.media_root),
        vision=vision,
        decode_images=settings.decode_images,
        full_decode=settings.full_decode,
    )
    return _Worker(
        vision=vision, counter=counter, validate=validate, ingest=IngestConfig(system_prompt=settings.system_prompt)
    )


def chunk_path(work: pathlib.Path, chunk: int, suffix: str) -> pathlib.Path:
    return pathlib.Path(work) / CHUNK_DIR / f"chunk-{chunk:06d}{suffix}"


def is_done(work: pathlib.Path, chunk: int) -> bool:
    """Whether the chunk's results are on disk (its summary is renamed into place last)."""
    return chunk_path(work, chunk, ".npz").is_file()


def process_chunk(settings: ChunkConfig, chunk: int, first_index: int, texts: list[str]) -> dict:
    """Parse, validate, count and fit one chunk; spill its results; return its counters and stage times."""
    worker = _worker(settings)
    pairs = settings.kind == "preference"
    times = {"ingest": 0.0, "validate": 0.0, "count": 0.0}
    rejections: list[Rejection] = []
    start = time.perf_counter()
    canonical = []
    for index, text in enumerate(texts, start=first_index):
        record = parse_record(index, text)
        item = record if isinstance(record, Rejection) else _canonical(index, record, worker.ingest, pairs)
        (rejections if isinstance(item, Rejection) else canonical).append(item)
    times["ingest"] = time.perf_counter() - start
    start = time.perf_counter()
    valid = []
    for item in canonical:
        checked = (validate_pair if pairs else validate_sample)(item, worker.validate)
        (rejections if isinstance(checked, Rejection) else valid).append(checked)
    times["validate"] = time.perf_counter() - start
    start = time.perf_counter()
    kept, truncated = [], 0
    batch_size = max(1, settings.count_batch_size // 2) if pairs else settings.count_batch_size
    for batch_start in range(0, len(valid), batch_size):
        batch = valid[batch_start : batch_start + batch_size]
        if pairs:  # a pair is one item of two samples; truncation does not apply to pairs (prepare refuses it)
            kept += count_pairs(batch, worker.counter, settings.seq_length, rejections)
            continue
        for sample in worker.counter.count(batch):
            fitted = _fit(sample, worker.counter, settings, rejections)
            if fitted is not None:
                truncated += fitted is not sample
                kept.append([fitted])
    times["count"] = time.perf_counter() - start
    rejections.sort(key=lambda r: r.index)
    _spill(settings.work, chunk, kept, rejections, read=len(texts), truncated=truncated)
    return {"chunk": chunk, "read": len(texts), "accepted": len(kept), "times": times}


def _canonical(index: int, record: dict, config: IngestConfig, pairs: bool):
    """A record as a PreferencePair (preference datasets) or a Conversation; a record with a rejected side is never
    read as SFT (its chosen side alone would be trained)."""
    if pairs:
        return to_pair(index, record, config)
    if keys := preference_keys(record):
        detail = f"record has {', '.join(map(repr, keys))}: a preference pair; prepare it with --kind preference"
        return Rejection(index=index, reason="preference_record", detail=detail)
    return to_conversation(index, record, config)


def _fit(sample: TokenizedSample, counter: TokenCounter, settings: ChunkConfig, rejections: list):
    if sample.length <= settings.seq_length:
        return sample
    if settings.truncate:
        cut = truncate(sample, settings.seq_length, counter.pad_ids)
        if cut is not None:
            return cut
    detail = f"{sample.length} tokens > seq_length {settings.seq_length}"
    rejections.append(Rejection(index=sample.index, reason="too_long", detail=detail))
    return None


def _spill(work, chunk: int, kept: list[list[TokenizedSample]], rejections: list[Rejection], read: int, truncated: int):
    """Write the chunk's files; `kept` holds each item's samples (one, or a pair's two that share their media)."""
    blobs = [b"".join(encode_sample(s) for s in subs) for subs in kept]
    sizes = np.asarray([len(b) for b in blobs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(blobs) else sizes
    # An item's vision cost is its first sample's media: the tower encodes a pair's shared images once.
    grids = [g for subs in kept for g in list(subs[0].image_grids) + list(subs[0].video_grids)]
    owners = [k for k, subs in enumerate(kept) for _ in range(len(subs[0].image_grids) + len(subs[0].video_grids))]
    videos = [kind for subs in kept for kind in [False] * len(subs[0].image_grids) + [True] * len(subs[0].video_grids)]
    meta = {"read": read, "truncated": truncated, "rejections": [r.to_json() for r in rejections]}
    _write_atomic(chunk_path(work, chunk, ".bin"), b"".join(blobs))
    summary = io.BytesIO()
    np.savez(
        summary,
        index=np.asarray([subs[0].index for subs in kept], dtype=np.int64),
        length=np.asarray([sum(s.length for s in subs) for subs in kept], dtype=np.int64),
        first_length=np.asarray([subs[0].length for subs in kept], dtype=np.int64),
        offset=offsets,
        size=sizes,
        grid_thw=np.asarray(grids, dtype=np.int64).reshape(-1, 3),
        grid_owner=np.asarray(owners, dtype=np.int64),
        grid_video=np.asarray(videos, dtype=bool),
        meta=np.frombuffer(json.dumps(meta, ensure_ascii=False).encode("utf-8", "surrogateescape"), dtype=np.uint8),
    )
    _write_atomic(chunk_path(work, chunk, ".npz"), summary.getvalue())


def _write_atomic(path: pathlib.Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_summary(work: pathlib.Path, chunk: int) -> dict:
    """A finished chunk's per-sample arrays and its `meta` (read, truncated, rejections) as a dict."""
    with np.load(chunk_path(work, chunk, ".npz")) as data:
        out = {key: data[key] for key in data.files if key != "meta"}
        out["meta"] = json.loads(data["meta"].tobytes().decode("utf-8", "surrogateescape"))
    return out


# --- one sample as bytes ---------------------------------------------------------------------------------


def encode_sample(sample: TokenizedSample) -> bytes:
    """A TokenizedSample as bytes: a JSON header (lengths, grids, media), then ids, loss and runs."""
    header = {
        "index": sample.index,
        "n": len(sample.ids),
        "runs": len(sample.runs),
        "image_grids": sample.image_grids,
        "video_grids": sample.video_grids,
        "video_second_per_grid": sample.video_second_per_grid,
        "media_first_token": sample.media_first_token,
        "media": [_media_json(m) for m in sample.media],
    }
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")
    arrays = (
        np.ascontiguousarray(sample.ids, np.int32).tobytes()
        + np.ascontiguousarray(sample.loss, np.uint8).tobytes()
        + np.ascontiguousarray(sample.runs, np.int32).tobytes()
    )
    return len(head).to_bytes(4, "little") + head + arrays


def decode_samples(blob: bytes) -> list[TokenizedSample]:
    """The TokenizedSamples of an item's blob (`encode_sample`'s bytes, back to back: one sample, or a pair's two)."""
    samples, start = [], 0
    while start < len(blob):
        sample, start = _decode_at(blob, start)
        samples.append(sample)
    return samples


def _decode_at(blob: bytes, start: int) -> tuple[TokenizedSample, int]:
    """The sample whose bytes start at `start`, and where the next one starts."""
    size = int.from_bytes(blob[start : start + 4], "little")
    header = json.loads(blob[start + 4 : start + 4 + size].decode("utf-8", "surrogateescape"))
    n, n_runs, pos = header["n"], header["runs"], start + 4 + size
    ids = np.frombuffer(blob, np.int32, n, pos)
    loss = np.frombuffer(blob, np.uint8, n, pos + 4 * n)
    runs = np.frombuffer(blob, np.int32, n_runs, pos + 5 * n)
    sample = TokenizedSample(
        index=header["index"],
        ids=ids,
        loss=loss,
        runs=runs,
        image_grids=[tuple(g) for g in header["image_grids"]],
        video_grids=[tuple(g) for g in header["video_grids"]],
        video_second_per_grid=header["video_second_per_grid"],
        media_first_token=header["media_first_token"],
        media=[_media_from_json(m) for m in header["media"]],
    )
    return sample, pos + 5 * n + 4 * n_runs


def _media_json(media: MediaInfo) -> dict:
    return {
        "kind": media.kind,
        "path": str(media.path),
        "height": media.height,
        "width": media.width,
        "frame_paths": [str(p) for p in media.frame_paths],
        "frame_indices": media.frame_indices,
        "total_frames": media.total_frames,
        "fps": media.fps,
    }


def _media_from_json(media: dict) -> MediaInfo:
    return MediaInfo(
        kind=media["kind"],
        path=pathlib.Path(media["path"]),
        height=media["height"],
        width=media["width"],
        frame_paths=[pathlib.Path(p) for p in media["frame_paths"]],
        frame_indices=media["frame_indices"],
        total_frames=media["total_frames"],
        fps=media["fps"],
    )


class SampleReader:
    """Random access to spilled samples by (chunk, offset, size), one open file per chunk at a time."""

    def __init__(self, work: pathlib.Path, max_open: int = 64):
        self.work = pathlib.Path(work)
        self.max_open = max_open
        self._files: dict[int, int] = {}

    def read(self, chunk: int, offset: int, size: int) -> list[TokenizedSample]:
        """The samples of one spilled item (one, or a pair's chosen and rejected side)."""
        fd = self._files.get(chunk)
        if fd is None:
            if len(self._files) >= self.max_open:
                os.close(self._files.pop(next(iter(self._files))))
            fd = self._files[chunk] = os.open(chunk_path(self.work, chunk, ".bin"), os.O_RDONLY)
        return decode_samples(os.pread(fd, size, offset))

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
