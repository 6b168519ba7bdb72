"""Validate: every sample is checked before it costs tokenizer or packing time; failures become Rejections.

Checks, in order (the first failure is the reason): text is valid UTF-8 and free of Qwen's special-token
strings; the sample is not empty; roles alternate user/assistant after an optional system turn and end on an
assistant turn; placeholders match the listed media; each image exists, is intact (`qvl.data.integrity`) and
can be resized by the family's rule; each video (file or frame folder) exists, has frames of one size and can be resized.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from dataclasses import dataclass, field

from PIL import Image

from qvl.data.ingest import Conversation, MediaRef, Rejection
from qvl.data.integrity import check_image_file
from qvl.data.vision import VisionConfig, sample_video_frame_indices, smart_resize, video_grid_thw
from qvl.foundation.families import SPECIAL_TOKENS

logger = logging.getLogger(__name__)

FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
REASONS = (
    "bad_json",
    "bad_format",
    "invalid_utf8",
    "special_token_in_text",
    "empty",
    "bad_roles",
    "no_assistant_turn",
    "placeholder_mismatch",
    "image_missing",
    "image_undecodable",
    "image_unresizable",
    "video_missing",
    "video_undecodable",
    "video_unresizable",
    "too_long",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class ValidateConfig:
    """Where media live and how hard to look at them."""

    media_root: pathlib.Path
    vision: VisionConfig
    decode_images: bool = True  # check every file is intact (truncated, corrupt); False only reads headers
    full_decode: bool = False  # decode every pixel instead of qvl.data.integrity's structure and CRC checks


@dataclass(kw_only=True, slots=True)
class MediaInfo:
    """A checked image or video: where it is and the sizes the token count needs."""

    kind: str  # "image" | "video"
    path: pathlib.Path
    height: int
    width: int
    frame_paths: list[pathlib.Path] = field(default_factory=list)  # frame folders only
    frame_indices: list[int] = field(default_factory=list)  # videos: the frames the processor uses
    total_frames: int = 1  # videos: frames in the source before sampling
    fps: float | None = None  # videos: frame rate of the source (file) or of the folder's frames

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices) if self.kind == "video" else 1


@dataclass(kw_only=True, slots=True)
class ValidSample:
    """A sample that passed every check."""

    conversation: Conversation
    media: list[MediaInfo]

    @property
    def index(self) -> int:
        return self.conversation.index


def validate_sample(conversation: Conversation, config: ValidateConfig) -> ValidSample | Rejection:
    """Check one conversation and its media; return it with media sizes, or the first failure."""
    for check in (_check_text, _check_roles, _check_placeholders):
        failure = check(conversation)
        if failure is not None:
            reason, detail = failure
            return Rejection(index=conversation.index, reason=reason, detail=detail)
    media = []
    for ref in conversation.media:
        info = _check_media(ref, config)
        if isinstance(info, tuple):
            return Rejection(index=conversation.index, reason=info[0], detail=info[1])
        media.append(info)
    return ValidSample(conversation=conversation, media=media)


def _texts(conversation: Conversation):
    for message in conversation.messages:
        yield message["role"]
        for part in message["content"]:
            if part["type"] == "text":
                yield part["text"]
    for ref in conversation.media:
        yield ref.path


def _check_text(conversation: Conversation) -> tuple[str, str] | None:
    for text in _texts(conversation):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return "invalid_utf8", f"invalid UTF-8 near {text[max(0, err.start - 20) : err.start]!r}"
        for token in SPECIAL_TOKENS:  # in user text they would be parsed as chat or vision markup
            if token in text:
                return "special_token_in_text", f"text contains the special token {token}"
    if not conversation.messages:
        return "empty", "no turns"
    for position, message in enumerate(conversation.messages):
        has_text = any(p["type"] == "text" and p["text"].strip() for p in message["content"])
        has_media = any(p["type"] != "text" for p in message["content"])
        if not has_text and not (has_media and message["role"] == "user"):
            return "empty", f"{message['role']} turn {position} has no content"
    return None


def _check_roles(conversation: Conversation) -> tuple[str, str] | None:
    roles = [m["role"] for m in conversation.messages]
    unknown = sorted({r for r in roles if r not in ("system", "user", "assistant")})
    if unknown:
        return "bad_roles", f"unknown role(s) {unknown}; use human/gpt/system or user/assistant/system"
    body = roles[1:] if roles[0] == "system" else roles
    if "assistant" not in body:
        return "no_assistant_turn", "no assistant turn to learn from"
    for position, role in enumerate(body):
        expected = "user" if position % 2 == 0 else "assistant"
        if role != expected:
            return "bad_roles", f"turn {position} is {role}, expected {expected} (roles must alternate, user first)"
    if body[-1] != "assistant":
        return "bad_roles", "conversation ends with a user turn that has no answer"
    return None


def _check_placeholders(conversation: Conversation) -> tuple[str, str] | None:
    for kind in ("image", "video"):
        found = conversation.placeholder_counts.get(kind, 0)
        listed = conversation.listed_counts.get(kind, 0)
        if found != listed:
            return "placeholder_mismatch", f"{found} <{kind}> placeholder(s) but {listed} {kind}(s) listed"
    return None


def _check_media(ref: MediaRef, config: ValidateConfig) -> MediaInfo | tuple[str, str]:
    path = config.media_root / ref.path
    if ref.kind == "image":
        return _check_image(path, config)
    if not path.exists():
        return "video_missing", f"{ref.path} not found under {config.media_root}"
    if path.is_dir():
        return _check_frame_folder(path, ref, config)
    return _check_video_file(path, config)


def _read_image_size(path: pathlib.Path, config: ValidateConfig) -> tuple[int, int]:
    with Image.open(path) as image:
        width, height = image.size  # from the header
        if config.full_decode:
            image.load()
        elif config.decode_images:
            check_image_file(path, image)
        else:
            image.verify()
    return height, width


@functools.lru_cache(maxsize=1 << 16)
def _image_size_or_error(path: pathlib.Path, config: ValidateConfig) -> tuple[int, int] | str:
    """An image's (height, width), or why it cannot be used; each file is opened once per process."""
    if not path.is_file():
        return "missing"
    try:
        return _read_image_size(path, config)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return f"{path.name}: {err}"


def _check_image(path: pathlib.Path, config: ValidateConfig) -> MediaInfo | tuple[str, str]:
    size = _image_size_or_error(path, config)
    if size == "missing":
        return "image_missing", f"{path} not found"
    if isinstance(size, str):
        return "image_undecodable", size
    height, width = size
    vision = config.vision
    try:
        smart_resize(height, width, vision.factor, vision.min_pixels, vision.max_pixels)
    except ValueError as err:
        return "image_unresizable", f"{path.name} ({width}x{height}): {err}"
    return MediaInfo(kind="image", path=path, height=height, width=width)


def _check_frame_folder(path: pathlib.Path, ref: MediaRef, config: ValidateConfig) -> MediaInfo | tuple[str, str]:
    frames = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not frames:
        return "video_undecodable", f"frame folder {path.name} holds no image frames"
    sizes = set()
    for frame in frames:
        try:
            sizes.add(_read_image_size(frame, config))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            return "video_undecodable", f"frame {frame.name}: {err}"
    if len(sizes) != 1:
        return "video_undecodable", f"frames of {path.name} differ in size: {sorted(sizes)}"
    (height, width), fps = sizes.pop(), ref.fps or config.vision.video_fps
    if fps is None and config.vision.record.video_needs_fps:
        return (
            "video_undecodable",
            f"frame folder {path.name} has no fps; give 'fps' in the sample or the processor config",
        )
    info = MediaInfo(
        kind="video",
        path=path,
        height=height,
        width=width,
        frame_paths=frames,
        frame_indices=list(range(len(frames))),
        total_frames=len(frames),
        fps=fps,
    )
    return _check_video_resizable(info, config)


def _check_video_file(path: pathlib.Path, config: ValidateConfig) -> MediaInfo | tuple[str, str]:
    try:
        total, fps, height, width = probe_video_file(path)
        indices = sample_video_frame_indices(total, fps, config.vision)
    except (OSError, ValueError) as err:
        return "video_undecodable", f"{path.name}: {err}"
    info = MediaInfo(
        kind="video",
        path=path,
        height=height,
        width=width,
        frame_indices=[int(i) for i in indices],
        total_frames=total,
        fps=fps,
    )
    return _check_video_resizable(info, config)


def _check_video_resizable(info: MediaInfo, config: ValidateConfig) -> MediaInfo | tuple[str, str]:
    try:
        video_grid_thw(info.num_frames, info.height, info.width, config.vision)
    except ValueError as err:
        return "video_unresizable", f"{info.path.name} ({info.width}x{info.height}): {err}"
    return info


def probe_video_file(path: pathlib.Path) -> tuple[int, float | None, int, int]:
    """(frame count, fps, height, width) of a video file from its container, decoding only if it has no count."""
    import av  # PyAV: only needed when a dataset has video files

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else None
            height, width, total = stream.codec_context.height, stream.codec_context.width, stream.frames
            if not total:
                total = sum(1 for _ in container.decode(stream))
    except (av.error.FFmpegError, IndexError) as err:
        raise ValueError(f"cannot read video: {err}") from err
    if total <= 0:
        raise ValueError("video has no frames")
    return total, fps, height, width
