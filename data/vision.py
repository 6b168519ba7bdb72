"""Vision token rules of the Qwen-VL families: resize settings from the HF processor config, grids, token counts.

These mirror transformers 5.12 (`Qwen2VLImageProcessor`, `Qwen2VLVideoProcessor`, `Qwen3VLVideoProcessor`,
`smart_resize` in `image_processing_qwen2_vl` / `video_processing_qwen3_vl`) so that a count computed from an
image header equals what the processor produces; tests compare them on many sizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass

import numpy as np

from qvl.foundation.families import Family, get_family

# Class defaults transformers falls back to when the config omits a key. Images use Qwen2VLImageProcessor for
# every family (Qwen3-VL checkpoints set patch_size=16 in their config); video defaults are the family's.
IMAGE_DEFAULTS = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
}
MAX_ASPECT_RATIO = 200  # smart_resize refuses anything more elongated


@dataclass(kw_only=True, slots=True, frozen=True)
class VisionConfig:
    """Resize and patch settings of one family, as its HF image and video processors would load them."""

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    video_patch_size: int
    video_min_pixels: int
    video_max_pixels: int
    video_fps: float | None  # frames per second to sample from video files (and the rate of frame folders)
    video_min_frames: int
    video_max_frames: int
    video_do_sample_frames: bool

    @property
    def record(self) -> Family:
        """The family's record (processor behaviour flags)."""
        return get_family(self.family)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def check_family(family: str) -> str:
    """Return `family` if known, else raise naming the valid ones."""
    return get_family(family).name


def load_vision_config(hf_path: pathlib.Path, family: str, **overrides) -> VisionConfig:
    """Read the processor configs in `hf_path` the way transformers does; `overrides` (e.g. max_pixels) win."""
    check_family(family)
    hf_path = pathlib.Path(hf_path)
    image_cfg = _read_json(hf_path, "preprocessor_config.json", "image_processor")
    video_cfg = _read_json(hf_path, "video_preprocessor_config.json", "video_processor") or image_cfg
    image = _resolve(image_cfg, IMAGE_DEFAULTS)
    video = _resolve(video_cfg, dict(get_family(family).video_defaults))
    config = VisionConfig(
        family=family,
        patch_size=image["patch_size"],
        temporal_patch_size=image["temporal_patch_size"],
        merge_size=image["merge_size"],
        min_pixels=image["min_pixels"],
        max_pixels=image["max_pixels"],
        video_patch_size=video["patch_size"],
        video_min_pixels=video["min_pixels"],
        video_max_pixels=video["max_pixels"],
        video_fps=None if video["fps"] is None else float(video["fps"]),
        video_min_frames=video["min_frames"],
        video_max_frames=video["max_frames"],
        video_do_sample_frames=bool(video["do_sample_frames"]),
    )
    unknown = set(overrides) - {f.name for f in dataclasses.fields(VisionConfig)}
    if unknown:
        raise ValueError(
            f"unknown vision override(s) {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(VisionConfig)]}"
        )
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def _read_json(hf_path: pathlib.Path, name: str, processor_key: str) -> dict:
    path = hf_path / name
    if path.is_file():
        return json.loads(path.read_text())
    combined = hf_path / "processor_config.json"  # transformers 5 may save every sub-processor in one file
    if combined.is_file():
        return json.loads(combined.read_text()).get(processor_key, {})
    return {}


def _resolve(cfg: dict, defaults: dict) -> dict:
    out = {key: cfg.get(key, default) for key, default in defaults.items() if key not in ("min_pixels", "max_pixels")}
    size = cfg.get("size") or {}
    # Same precedence as the processors' __init__: explicit min_pixels/max_pixels override `size`.
    out["min_pixels"] = (
        cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or defaults["min_pixels"]
    )
    out["max_pixels"] = (
        cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or defaults["max_pixels"]
    )
    return out


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize: sides divisible by `factor`, area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video_qwen3(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: the pixel budget covers all frames."""
    if height < factor or width < factor:
        raise ValueError(f"frame {height}x{width} is smaller than the patch factor {factor}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = math.ceil(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid_thw(height: int, width: int, config: VisionConfig) -> tuple[int, int, int]:
    """The (t, h, w) patch grid the image processor gives an image of height x width."""
    h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return 1, h // config.patch_size, w // config.patch_size


def vision_tokens_for_image(height: int, width: int, config: VisionConfig) -> int:
    """Number of <|image_pad|> tokens an image of height x width becomes."""
    t, h, w = image_grid_thw(height, width, config)
    return t * h * w // config.merge_size**2


def video_grid_thw(num_frames: int, height: int, width: int, config: VisionConfig) -> tuple[int, int, int]:
    """The (t, h, w) patch grid the video processor gives `num_frames` (already sampled) frames of height x width."""
    patch, factor = config.video_patch_size, config.video_patch_size * config.merge_size
    if config.record.video_frames_timestamped:  # Qwen3-VL: one pixel budget for the whole clip
        h, w = smart_resize_video_qwen3(
            num_frames,
            height,
            width,
            config.temporal_patch_size,
            factor,
            config.video_min_pixels,
            config.video_max_pixels,
        )
    else:
        h, w = smart_resize(height, width, factor, config.video_min_pixels, config.video_max_pixels)
    # The processor repeats the last frame up to a multiple of temporal_patch_size.
    grid_t = -(-num_frames // config.temporal_patch_size)
    return grid_t, h // patch, w // patch


def sample_video_frame_indices(total_frames: int, video_fps: float | None, config: VisionConfig) -> np.ndarray:
    """Indices of the frames the family's video processor samples from a decoded video file."""
    if not config.video_do_sample_frames or config.video_fps is None:
        return np.arange(total_frames)
    fps = video_fps if video_fps else 24.0  # transformers' own fallback when a container has no rate
    if config.record.video_frames_timestamped:  # Qwen3VLVideoProcessor: evenly spaced, no temporal rounding
        num = int(total_frames / fps * config.video_fps)
        num = min(max(num, config.video_min_frames), config.video_max_frames, total_frames)
        return np.linspace(0, total_frames - 1, num).round().astype(int)
    tps = config.temporal_patch_size
    max_frames = math.floor(min(config.video_max_frames, total_frames) / tps) * tps
    num = total_frames / fps * config.video_fps
    num = math.floor(min(max(num, config.video_min_frames), max_frames, total_frames) / tps) * tps
    if num <= 0:
        raise ValueError(f"video of {total_frames} frames is too short to sample {tps} frames")
    import torch  # torch's float arange decides the exact indices transformers gets

    return torch.arange(0, total_frames, total_frames / num).int().numpy()


def video_timestamps(frame_indices: np.ndarray, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's per-temporal-patch timestamps (mean time of the first and last frame of each patch)."""
    indices = [int(i) for i in frame_indices]
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]
