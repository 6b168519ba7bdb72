"""Encode: the Energon TaskEncoder turning written packs into THD batches for Megatron's Qwen-VL models.

A batch concatenates its packs into one token stream (`tokens` [1, T]) with `cu_seqlens_q`/`cu_seqlens_kv`
marking every sub-sequence, next-token `labels` that learn only assistant tokens and never cross a
sub-sequence boundary, per-sub-sequence 3-D mRoPE `position_ids` [3, 1, T], and the vision inputs
(`pixel_values` + `image_grid_thw`, `pixel_values_videos` + `video_grid_thw` [+ `second_per_grid_ts`]).
Images go through the family's HF image processor (PIL backend); video frames are resized with PIL and
patchified like the HF video processor (grids exact, interpolation may differ slightly from torchvision's).

A tar member that several placeholders of a pack name (a preference pair's sides share their images) is decoded
once. With `deduplicate_vision` (the preference encoder's default; off for SFT) a micro-batch also says which of
its images are the same (`image_sources` / `video_sources`: each one's distinct index; the same tar member within a
pack, or the same bytes across packs) and its tower inputs are those of the distinct grid: the step then gives the
tower each distinct image once (qvl.training.step, qvl.kernels.tower_inputs.VisionSources). The pixels keep one entry
per placeholder, as without it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pathlib
from dataclasses import field
from typing import Any

import numpy as np
import torch
from megatron.energon import Batch, Cooker, DefaultTaskEncoder, Sample, edataclass, stateless
from PIL import Image

from qvl.data.count import IGNORE_INDEX, IMAGE_PAD, VIDEO_PAD
from qvl.data.mrope import RopeConfig, packed_position_ids
from qvl.data.vision import VisionConfig, check_family, load_vision_config
from qvl.foundation.families import get_family
from qvl.kernels.tower_inputs import (
    MegatronTowerInputs,
    TowerInputs,
    distinct_rows,
    first_occurrences,
    tower_inputs_for_config,
)

logger = logging.getLogger(__name__)


@edataclass
class PackRecord(Sample):
    """A pack as stored: metadata, concatenated token ids and loss mask, media bytes by member name."""

    meta: dict
    ids: np.ndarray
    loss: np.ndarray
    media: dict


@edataclass
class PackedSample(Sample):
    """One encoded pack (THD: no batch dimension)."""

    tokens: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX where not learned
    loss_mask: torch.Tensor  # [T] float32
    position_ids: torch.Tensor  # [3, T] int64
    cu_seqlens: torch.Tensor  # [n_sub + 1] int32
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor  # [n_videos, 3]
    second_per_grid_ts: torch.Tensor  # [n_videos] (Qwen2.5-VL)
    source_indices: list[int] = field(default_factory=list)
    # With deduplicate_vision: a content key per image / video (equal keys: the same pixels); else empty
    image_keys: list[str] = field(default_factory=list)
    video_keys: list[str] = field(default_factory=list)


@edataclass
class PackedBatch(Batch):
    """Packs of a micro-batch concatenated into one THD sequence, with Megatron-Bridge's packed-seq keys."""

    tokens: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]
    loss_mask: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [3, 1, T]
    cu_seqlens_q: torch.Tensor  # [n_sub + 1] int32
    cu_seqlens_kv: torch.Tensor
    max_seqlen: int
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor
    source_indices: list[list[int]]
    # What the vision tower derives from each grid (HF towers: TowerInputs; Megatron-Bridge's Qwen3-VL tower:
    # MegatronTowerInputs), computed here in the worker processes (qvl.kernels.tower_inputs); None for a
    # micro-batch without that modality.
    image_tower_inputs: TowerInputs | MegatronTowerInputs | None = None
    video_tower_inputs: TowerInputs | MegatronTowerInputs | None = None
    # With deduplicate_vision, where an image (video) repeats in the micro-batch: int64 [n_images] each one's distinct
    # index, numbered in order of first occurrence; the tower inputs above are then the distinct grid's. None where
    # nothing repeats (or without deduplicate_vision).
    image_sources: torch.Tensor | None = None
    video_sources: torch.Tensor | None = None


@stateless
def cook_pack(sample: dict) -> PackRecord:
    """Crude tar sample (raw bytes) -> PackRecord."""
    meta = json.loads(sample["json"])
    media = {k: v for k, v in sample.items() if k.startswith(("img", "vid"))}
    return PackRecord(
        __key__=sample["__key__"],
        __restore_key__=sample["__restore_key__"],
        __subflavors__=sample.get("__subflavors__"),
        __sources__=sample.get("__sources__"),
        meta=meta,
        ids=np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False),
        loss=np.load(io.BytesIO(sample["loss.npy"]), allow_pickle=False),
        media=media,
    )


def shifted_labels(ids: np.ndarray, loss: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Next-token labels per sub-sequence: label[t] = ids[t+1] where ids[t+1] is learned, else IGNORE_INDEX."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    learn_next = np.zeros(len(ids), dtype=bool)
    learn_next[:-1] = loss[1:].astype(bool)
    ends = np.cumsum(lengths) - 1
    learn_next[ends] = False  # never predict across a sub-sequence boundary
    labels[learn_next] = ids[1:][learn_next[:-1]]
    return labels


class QwenVLPackedTaskEncoder(DefaultTaskEncoder[PackRecord, PackedSample, PackedBatch, PackedBatch]):
    """Energon TaskEncoder for datasets written by `qvl data prepare`."""

    cookers = [Cooker(cook_pack)]
    decoder = None  # members arrive as raw bytes; images keep their original encoding until here

    def __init__(
        self,
        *,
        hf_path: pathlib.Path,
        family: str,
        tokens_per_second: int | None = None,
        deduplicate_vision: bool = False,
        **vision_overrides,
    ):
        super().__init__()
        self.deduplicate_vision = deduplicate_vision
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.family = check_family(family)
        self.vision: VisionConfig = load_vision_config(hf_path, family, **vision_overrides)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
            str(hf_path), min_pixels=self.vision.min_pixels, max_pixels=self.vision.max_pixels
        )
        tokenizer = AutoTokenizer.from_pretrained(str(hf_path))
        image_pad, video_pad = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD])
        self.rope = RopeConfig(
            family=family,
            spatial_merge_size=self.vision.merge_size,
            image_pad_id=image_pad,
            video_pad_id=video_pad,
            tokens_per_second=tokens_per_second or _tokens_per_second(hf_path),
        )
        self.video_mean, self.video_std = _video_normalization(hf_path, family)
        self.tower_config = _vision_config(hf_path)

    @stateless
    def encode_sample(self, sample: PackRecord) -> PackedSample:
        subs = sample.meta["subs"]
        lengths = [s["length"] for s in subs]
        ids = sample.ids.astype(np.int64)
        sub_ids = np.split(ids, np.cumsum(lengths)[:-1])
        labels = shifted_labels(ids, sample.loss, lengths)
        pixel_values, image_grids, image_keys = self._images(sample, subs)
        pixel_values_videos, video_grids, seconds, video_keys = self._videos(sample, subs)
        return PackedSample.derive_from(
            sample,
            tokens=torch.from_numpy(ids),
            labels=torch.from_numpy(labels),
            loss_mask=torch.from_numpy((labels != IGNORE_INDEX).astype(np.float32)),
            position_ids=torch.from_numpy(np.ascontiguousarray(packed_position_ids(sub_ids, subs, self.rope))),
            cu_seqlens=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor(image_grids, dtype=torch.long).reshape(-1, 3),
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=torch.tensor(video_grids, dtype=torch.long).reshape(-1, 3),
            second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32),
            source_indices=list(sample.meta["samples"]),
            image_keys=image_keys,
            video_keys=video_keys,
        )

    def _images(self, sample: PackRecord, subs: list[dict]) -> tuple[torch.Tensor | None, list, list[str]]:
        """The pack's image pixels (one entry per placeholder, each distinct member decoded once), grids and keys."""
        members = [m["member"] for s in subs for m in s["media"] if m["kind"] == "image"]
        grids = [g for s in subs for g in s["image_grid_thw"]]
        if not members:
            return None, grids, []
        distinct = {member: index for index, member in enumerate(dict.fromkeys(members))}
        images = [Image.open(io.BytesIO(sample.media[m])).convert("RGB") for m in distinct]
        out = self.image_processor(images=images, return_tensors="pt")
        sources = torch.tensor([distinct[m] for m in members], dtype=torch.long)
        processed = out["image_grid_thw"][sources]
        if processed.tolist() != grids:
            raise ValueError(
                f"pack {sample.__key__}: image grids {processed.tolist()} differ from the written {grids}; "
                "the dataset was prepared with other processor settings than this --tokenizer dir"
            )
        keys = {m: _content_key(sample.media[m]) for m in distinct} if self.deduplicate_vision else {}
        pixels = _per_placeholder(out["pixel_values"], sources, processed)
        return pixels, grids, [keys[m] for m in members] if keys else []

    def _videos(self, sample: PackRecord, subs: list[dict]) -> tuple[torch.Tensor | None, list, list, list[str]]:
        """The pack's video pixels (one entry per placeholder, each distinct video decoded once), grids, seconds per
        grid and keys."""
        entries = [m for s in subs for m in s["media"] if m["kind"] != "image"]
        grids = [g for s in subs for g in s["video_grid_thw"]]
        seconds = [x for s in subs for x in s.get("second_per_grid_ts", [])]
        if not entries:
            return None, grids, seconds, []
        identities = [_video_identity(e, grid) for e, grid in zip(entries, grids, strict=True)]
        firsts: dict[tuple, tuple[dict, list]] = {}
        for identity, entry, grid in zip(identities, entries, grids):
            firsts.setdefault(identity, (entry, grid))
        distinct = {identity: index for index, identity in enumerate(firsts)}
        patches = [self._video_patches(self._frames(sample, e), grid) for e, grid in firsts.values()]
        sources = torch.tensor([distinct[i] for i in identities], dtype=torch.long)
        keys = {i: _video_key(sample, i) for i in distinct} if self.deduplicate_vision else {}
        pixels = _per_placeholder(torch.cat(patches), sources, torch.tensor(grids, dtype=torch.long))
        return pixels, grids, seconds, [keys[i] for i in identities] if keys else []

    def _frames(self, sample: PackRecord, entry: dict) -> list[Image.Image]:
        if entry["kind"] == "frames":
            return [Image.open(io.BytesIO(sample.media[m])).convert("RGB") for m in entry["members"]]
        import av

        wanted = set(entry["frame_indices"])
        with av.open(io.BytesIO(sample.media[entry["member"]])) as container:
            decoded = [f.to_image() for i, f in enumerate(container.decode(video=0)) if i in wanted]
        by_index = dict(zip(sorted(wanted), decoded))
        return [by_index[i].convert("RGB") for i in entry["frame_indices"]]

    def _video_patches(self, frames: list[Image.Image], grid: list[int]) -> torch.Tensor:
        """Resize, normalise and patchify frames exactly in the HF video processor's layout."""
        grid_t, grid_h, grid_w = grid
        patch, merge, tps = self.vision.video_patch_size, self.vision.merge_size, self.vision.temporal_patch_size
        size = (grid_w * patch, grid_h * patch)
        array = np.stack([np.asarray(f.resize(size, Image.Resampling.BICUBIC), dtype=np.float32) for f in frames])
        array = (array / 255.0 - self.video_mean) / self.video_std
        video = torch.from_numpy(array).permute(0, 3, 1, 2)  # [T, C, H, W]
        if pad := -len(frames) % tps:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        channels = video.shape[1]
        video = video.view(grid_t, tps, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        video = video.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return video.reshape(grid_t * grid_h * grid_w, channels * tps * patch * patch).contiguous()

    @stateless
    def batch(self, samples: list[PackedSample]) -> PackedBatch:
        image_sources = self._sources([s.image_keys for s in samples])
        video_sources = self._sources([s.video_keys for s in samples])
        lengths = [int(s.tokens.numel()) for s in samples]
        offsets = np.r_[0, np.cumsum(lengths)[:-1]]
        cu = torch.cat([samples[0].cu_seqlens[:1]] + [s.cu_seqlens[1:] + int(o) for s, o in zip(samples, offsets)])
        return PackedBatch(
            __key__=[s.__key__ for s in samples],
            __restore_key__=("Encoded", "batch", tuple(s.__restore_key__ for s in samples)),
            tokens=torch.cat([s.tokens for s in samples])[None],
            labels=torch.cat([s.labels for s in samples])[None],
            loss_mask=torch.cat([s.loss_mask for s in samples])[None],
            position_ids=torch.cat([s.position_ids for s in samples], dim=1)[:, None],
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu.clone(),
            max_seqlen=int(torch.diff(cu).max()),
            pixel_values=_cat_or_none([s.pixel_values for s in samples]),
            image_grid_thw=torch.cat([s.image_grid_thw for s in samples]),
            pixel_values_videos=_cat_or_none([s.pixel_values_videos for s in samples]),
            video_grid_thw=torch.cat([s.video_grid_thw for s in samples]),
            second_per_grid_ts=torch.cat([s.second_per_grid_ts for s in samples]),
            source_indices=[s.source_indices for s in samples],
            image_tower_inputs=self._tower_inputs([s.image_grid_thw for s in samples], image_sources),
            video_tower_inputs=self._tower_inputs([s.video_grid_thw for s in samples], video_sources),
            image_sources=image_sources,
            video_sources=video_sources,
        )

    def _sources(self, keys: list[list[str]]) -> torch.Tensor | None:
        """Each image's (video's) distinct index in the micro-batch from its packs' content keys, numbered in order of
        first occurrence; None without deduplicate_vision or where nothing repeats."""
        flat = [key for pack in keys for key in pack]
        index: dict[str, int] = {}
        sources = [index.setdefault(key, len(index)) for key in flat]
        if not self.deduplicate_vision or len(index) == len(flat):
            return None
        return torch.tensor(sources, dtype=torch.long)

    def _tower_inputs(
        self, grids: list[torch.Tensor], sources: torch.Tensor | None
    ) -> TowerInputs | MegatronTowerInputs | None:
        """The vision tower's inputs for one micro-batch's grids (its distinct ones where `sources` says which),
        once, on the host (None: nothing to compute)."""
        grid = torch.cat(grids)
        if self.tower_config is None or not grid.numel():
            return None
        return tower_inputs_for_config(grid if sources is None else grid[first_occurrences(sources)], self.tower_config)

    @stateless
    def encode_batch(self, batch: PackedBatch) -> PackedBatch:
        return batch


def _per_placeholder(pixels: torch.Tensor, sources: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """The pixel rows of each placeholder ([sum of `grids`' patches]) from those of each distinct item once
    (`pixels`, in order of first occurrence; `sources` each placeholder's distinct index)."""
    if torch.equal(sources, torch.arange(len(sources))):
        return pixels
    _, expanded = distinct_rows(sources, grids.reshape(-1, 3).prod(-1))
    return pixels.index_select(0, expanded)


def _content_key(*payloads: bytes | str) -> str:
    """A digest of a medium's bytes: equal keys, the same pixels (blake2b: fast, and collisions are not a concern)."""
    digest = hashlib.blake2b(digest_size=16)
    for payload in payloads:
        digest.update(payload.encode() if isinstance(payload, str) else payload)
    return digest.hexdigest()


def _video_identity(entry: dict, grid: list[int]) -> tuple:
    """What makes two video entries of a pack the same video: its members, chosen frames and grid."""
    members = tuple(entry["members"]) if entry["kind"] == "frames" else (entry["member"],)
    return (entry["kind"], members, tuple(entry.get("frame_indices", ())), tuple(grid))


def _video_key(sample: PackRecord, identity: tuple) -> str:
    """The content key of a video entry (`_video_identity`): its members' bytes, its frames and grid."""
    kind, members, frames, grid = identity
    return _content_key(*(sample.media[m] for m in members), json.dumps([kind, frames, grid]))


def _cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def _vision_config(hf_path: pathlib.Path) -> Any | None:
    """The checkpoint's vision config, from which the loader computes the tower's inputs; None for a directory
    without config.json."""
    if not (pathlib.Path(hf_path) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_path)).vision_config


def _tokens_per_second(hf_path: pathlib.Path) -> int | None:
    """Qwen2.5-VL's vision_config.tokens_per_second from the checkpoint's config.json, if there is one."""
    config = pathlib.Path(hf_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("vision_config", {}).get("tokens_per_second")


def _video_normalization(hf_path: pathlib.Path, family: str) -> tuple[np.ndarray, np.ndarray]:
    hf_path = pathlib.Path(hf_path)
    config: dict[str, Any] = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (hf_path / name).is_file():
            config = json.loads((hf_path / name).read_text())
            break
    mean, std = get_family(family).image_mean, get_family(family).image_std  # transformers' class defaults
    return (
        np.asarray(config.get("image_mean", mean), np.float32),
        np.asarray(config.get("image_std", std), np.float32),
    )
