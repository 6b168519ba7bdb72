"""Ingest: LLaVA/ShareGPT (`conversations`) and OpenAI-style (`messages`) JSON/JSONL into one canonical form.

The canonical `Conversation` holds chat-template messages (content as a list of text/image/video parts, the
format `tokenizer.apply_chat_template` takes) plus the media paths in placeholder order. A record that cannot
be read becomes a `Rejection` with its source index instead of an exception, so one bad line never stops a run.
"""

from __future__ import annotations

import codecs
import json
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from qvl.foundation.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDER_RE = re.compile(r"(<image>|<video>)")

# A turn's reasoning (thinking) text, under the names reasoning-trace datasets use; the chat template renders it.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# ShareGPT `from` / OpenAI `role` spellings -> chat-template roles.
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(kw_only=True, slots=True)
class MediaRef:
    """One image or video of a sample: a path relative to the media root, an optional frame rate for videos."""

    kind: str  # "image" | "video"
    path: str
    fps: float | None = None


@dataclass(kw_only=True, slots=True)
class Conversation:
    """A sample in canonical form: chat-template messages and its media in placeholder order."""

    index: int
    messages: list[dict]
    media: list[MediaRef] = field(default_factory=list)
    placeholder_counts: dict[str, int] = field(default_factory=dict)  # placeholders found in the text
    listed_counts: dict[str, int] = field(default_factory=dict)  # media listed beside the text
    # Learn only the last N assistant turns (a preference pair's completion; earlier ones are context); None: all.
    learn_last: int | None = None


@dataclass(kw_only=True, slots=True)
class Rejection:
    """A sample that failed a check: its source index, a reason code and a human-readable detail."""

    index: int
    reason: str
    detail: str = ""

    def to_json(self) -> dict:
        return {"index": self.index, "reason": self.reason, "detail": self.detail}


@dataclass(kw_only=True, slots=True)
class IngestConfig:
    """How records are read: an optional system prompt for samples that carry none."""

    system_prompt: str | None = None


def read_records(path: pathlib.Path) -> Iterator[tuple[int, dict | Rejection]]:
    """Yield (index, record) from a JSON array or JSONL file; unreadable records come back as Rejection."""
    for index, text in iter_record_texts(path):
        yield index, parse_record(index, text)


def iter_record_texts(path: pathlib.Path, block_size: int = 1 << 22) -> Iterator[tuple[int, str]]:
    """Yield (index, raw JSON text) of each record of a JSONL file or a JSON array, reading the file in blocks.

    Memory stays at one block plus one record however large the file is: a JSON array is split into its
    elements with `raw_decode` on a sliding buffer, never parsed as a whole.
    """
    with open(path, "rb") as f:
        head = f.read(block_size)
        f.seek(0)
        if head.lstrip()[:1] == b"[":
            yield from _iter_array_elements(f, path, block_size)
            return
        index = 0
        for line in f:
            # surrogateescape keeps invalid UTF-8 bytes visible (as lone surrogates) so the validator can name them.
            text = line.decode("utf-8", errors="surrogateescape")
            if not text.strip():
                continue
            yield index, text
            index += 1


_WHITESPACE_COMMA = re.compile(r"[\s,]*")


def _iter_array_elements(f, path: pathlib.Path, block_size: int) -> Iterator[tuple[int, str]]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    parser = json.JSONDecoder()
    buffer, eof, index = "", False, 0

    def fill() -> bool:
        nonlocal buffer, eof
        block = f.read(block_size)
        eof = not block
        buffer += decoder.decode(block, final=eof)
        return not eof

    fill()
    start = buffer.index("[") + 1
    while True:
        start = _WHITESPACE_COMMA.match(buffer, start).end()
        if start == len(buffer) and fill():
            continue
        if buffer.startswith("]", start):
            return
        try:
            _, end = parser.raw_decode(buffer, start)
        except json.JSONDecodeError as err:
            if not eof:  # the element may continue in the next block
                buffer, start = buffer[start:], 0
                fill()
                continue
            raise DataError(
                f"{path} is not valid JSON (element {index}: {err}); fix the file or convert it to JSONL, one sample "
                "a line"
            ) from None
        if end == len(buffer) and not eof:  # a bare number may go on in the next block
            fill()
            continue
        yield index, buffer[start:end]
        index += 1
        start = end
        if start > block_size:
            buffer, start = buffer[start:], 0


def parse_record(index: int, text: str) -> dict | Rejection:
    """One record's JSON text as a dict, or the Rejection that says why it is not one."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return Rejection(index=index, reason="bad_json", detail=str(err))
    if not isinstance(record, dict):
        return Rejection(index=index, reason="bad_format", detail=f"record is {type(record).__name__}, not an object")
    return record


def to_conversation(index: int, record: dict, config: IngestConfig) -> Conversation | Rejection:
    """Normalise one record (ShareGPT `conversations` or OpenAI `messages`) into a Conversation."""
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        return Rejection(index=index, reason="bad_format", detail="no 'conversations' or 'messages' list")
    if not isinstance(turns, list):
        return Rejection(index=index, reason="bad_format", detail="'conversations'/'messages' is not a list")
    listed = listed_media(record)
    if isinstance(listed, Rejection):
        return Rejection(index=index, reason=listed.reason, detail=listed.detail)
    conversation = Conversation(index=index, messages=[], media=[])
    conversation.listed_counts = {
        "image": sum(m.kind == "image" for m in listed),
        "video": sum(m.kind == "video" for m in listed),
    }
    queues = {"image": [m for m in listed if m.kind == "image"], "video": [m for m in listed if m.kind == "video"]}
    counts = {"image": 0, "video": 0}
    for turn in turns:
        message = _to_message(turn, queues, counts, conversation.media)
        if isinstance(message, str):
            return Rejection(index=index, reason="bad_format", detail=message)
        conversation.messages.append(message)
    conversation.placeholder_counts = counts
    if config.system_prompt is not None and not any(m["role"] == "system" for m in conversation.messages):
        conversation.messages.insert(0, {"role": "system", "content": [{"type": "text", "text": config.system_prompt}]})
    return conversation


def listed_media(record: dict) -> list[MediaRef] | Rejection:
    """The images and videos a record lists under `image`/`images` and `video`/`videos`, in that order."""
    media: list[MediaRef] = []
    for kind, keys in (("image", ("image", "images")), ("video", ("video", "videos"))):
        for key in keys:
            value = record.get(key)
            if value is None:
                continue
            for item in value if isinstance(value, list) else [value]:
                ref = _media_ref(kind, item, record.get("fps"))
                if ref is None:
                    return Rejection(index=-1, reason="bad_format", detail=f"'{key}' entry {item!r} is not a path")
                media.append(ref)
    return media


def _media_ref(kind: str, item, default_fps) -> MediaRef | None:
    if isinstance(item, str):
        return MediaRef(kind=kind, path=item, fps=_as_fps(default_fps))
    if isinstance(item, dict):
        path = item.get("path", item.get(kind, item.get("url")))
        if isinstance(path, str):
            return MediaRef(kind=kind, path=path, fps=_as_fps(item.get("fps", default_fps)))
    return None


def _as_fps(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _to_message(turn, queues: dict, counts: dict, media: list[MediaRef]) -> dict | str:
    if not isinstance(turn, dict):
        return f"turn {turn!r} is not an object"
    role = turn.get("from", turn.get("role"))
    if not isinstance(role, str):
        return "turn without 'from'/'role'"
    content = turn.get("value", turn.get("content"))
    parts: list[dict] = []
    if isinstance(content, str):
        _split_text(content, parts, queues, counts, media)
    elif isinstance(content, list):
        for part in content:
            error = _add_part(part, parts, queues, counts, media)
            if error:
                return error
    elif content is not None:
        return f"content of type {type(content).__name__} is neither text nor a list of parts"
    message = {"role": ROLE_ALIASES.get(role.lower(), role), "content": parts}
    reasoning = next((turn[key] for key in REASONING_KEYS if turn.get(key) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            return f"reasoning of type {type(reasoning).__name__} is not text"
        message["reasoning_content"] = reasoning  # the name Qwen's chat templates read
    return message


def _add_part(part, parts: list[dict], queues: dict, counts: dict, media: list[MediaRef]) -> str | None:
    if isinstance(part, str):
        _split_text(part, parts, queues, counts, media)
        return None
    if not isinstance(part, dict):
        return f"content part {part!r} is not an object"
    kind = part.get("type")
    if kind == "text" or (kind is None and "text" in part):
        if not isinstance(part.get("text"), str):
            return "text part without a string 'text'"
        _split_text(part["text"], parts, queues, counts, media)
        return None
    if kind in ("image", "video"):
        inline = _media_ref(kind, part.get(kind, part.get("path", part.get("url"))), part.get("fps"))
        if inline is not None:
            media.append(inline)  # an inline path is its own placeholder and media entry
            parts.append({"type": kind})
            return None
        _take_placeholder(kind, parts, queues, counts, media)
        return None
    return f"content part of unknown type {kind!r}"


def _split_text(text: str, parts: list[dict], queues: dict, counts: dict, media: list[MediaRef]) -> None:
    for piece in _PLACEHOLDER_RE.split(text):
        if piece == IMAGE_PLACEHOLDER:
            _take_placeholder("image", parts, queues, counts, media)
        elif piece == VIDEO_PLACEHOLDER:
            _take_placeholder("video", parts, queues, counts, media)
        elif piece:
            parts.append({"type": "text", "text": piece})


def _take_placeholder(kind: str, parts: list[dict], queues: dict, counts: dict, media: list[MediaRef]) -> None:
    counts[kind] += 1
    parts.append({"type": kind})
    if queues[kind]:
        media.append(queues[kind].pop(0))
