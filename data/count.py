"""Count: exact token ids and lengths per sample for a Qwen-VL family, without decoding any pixels.

Text goes through the model's tokenizer and chat template; every image/video placeholder is replaced the way
the family's processor replaces it, but each run of pad tokens is kept as ONE token plus a run length, so a
sample with a 16k-token image costs a few hundred ints until it is written. `TokenizedSample.expand()` gives
the exact ids the processor would produce (tests compare them token for token).
"""

from __future__ import annotations

import logging
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qvl.data.validate import MediaInfo, ValidSample
from qvl.data.vision import VisionConfig, image_grid_thw, video_grid_thw, video_timestamps
from qvl.foundation.errors import DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
_PAD_RE = re.compile(r"<\|image_pad\|>|<\|video_pad\|>")
# Loss covers the assistant's content and its closing <|im_end|>, not the role header.
_ASSISTANT_RE = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)
# A reasoning block as Qwen3 / 3.5 / 3.8 templates render it, with the blank line that separates it from the answer.
_REASONING_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
# Names a chat template reads that are not switches: the conversation, and what transformers passes itself.
_TEMPLATE_INPUTS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now"}
)
QWEN3_FPS_FALLBACK = 24.0  # what Qwen3VLProcessor assumes for a video without a frame rate


@dataclass(kw_only=True, slots=True)
class TokenizedSample:
    """A sample's tokens in compact form: each vision pad run is one id in `ids` with its length in `runs`."""

    index: int
    ids: np.ndarray  # int32 [n_compact]
    loss: np.ndarray  # uint8 [n_compact], 1 where the token is learned
    runs: np.ndarray  # int32 [n_runs], pad tokens per vision run, in order of appearance
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_second_per_grid: list[float] = field(default_factory=list)  # Qwen2.5-VL temporal spacing
    media_first_token: list[int] = field(default_factory=list)  # compact index of each media's vision_start
    media: list[MediaInfo] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Exact number of tokens after expanding the vision pads."""
        return int(len(self.ids) - len(self.runs) + self.runs.sum())

    def repeats(self, pad_ids: tuple[int, int]) -> np.ndarray:
        """Per compact token, how many tokens it expands to."""
        repeats = np.ones(len(self.ids), dtype=np.int64)
        repeats[_is_pad(self.ids, pad_ids)] = self.runs
        return repeats

    def expand(self, pad_ids: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, loss mask) exactly as the processor lays them out."""
        repeats = self.repeats(pad_ids)
        return np.repeat(self.ids, repeats), np.repeat(self.loss, repeats)


@dataclass(kw_only=True, slots=True)
class TokenCounter:
    """Turns validated samples into TokenizedSamples with a tokenizer (chat template included) and vision rules.

    `template_args`: the chat template's switches (`enable_thinking`, Qwen3.8's `reasoning_effort`, ...), passed to
    `apply_chat_template` as the processor would get them; `check_template_args` refuses one the template does not
    read. `reasoning_loss`: whether an assistant turn's reasoning block (`<think>...</think>`, rendered from its
    `reasoning_content` by the template) is learned with its answer (True, reasoning-trace SFT) or only read."""

    tokenizer: object  # transformers PreTrainedTokenizerFast
    vision: VisionConfig
    add_vision_id: bool = False
    template_args: tuple[tuple[str, Any], ...] = ()
    reasoning_loss: bool = True

    @property
    def pad_ids(self) -> tuple[int, int]:
        image, video = self.tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD])
        return image, video

    def count(self, samples: list[ValidSample]) -> list[TokenizedSample]:
        """Tokenize a batch of samples (one tokenizer call for the batch)."""
        texts, replacements = [], []
        for sample in samples:
            rendered = self.tokenizer.apply_chat_template(
                sample.conversation.messages,
                tokenize=False,
                add_vision_id=self.add_vision_id,
                **dict(self.template_args),
            )
            media_text = [self._replacement(m) for m in sample.media]
            texts.append(_replace_pads(rendered, [text for text, *_ in media_text]))
            replacements.append(media_text)
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [
            self._build(sample, text, ids, offsets, media_text)
            for sample, text, ids, offsets, media_text in zip(
                samples, texts, encoded["input_ids"], encoded["offset_mapping"], replacements, strict=True
            )
        ]

    def _replacement(self, media: MediaInfo) -> tuple[str, list[int], tuple[int, int, int], float | None]:
        """(text replacing the placeholder pad, pad-run lengths, grid, seconds per temporal patch)."""
        merge2 = self.vision.merge_size**2
        if media.kind == "image":
            grid = image_grid_thw(media.height, media.width, self.vision)
            return IMAGE_PAD, [grid[0] * grid[1] * grid[2] // merge2], grid, None
        grid = video_grid_thw(media.num_frames, media.height, media.width, self.vision)
        tps = self.vision.temporal_patch_size
        if self.vision.record.video_frames_timestamped:
            fps = media.fps or QWEN3_FPS_FALLBACK
            times = video_timestamps(np.asarray(media.frame_indices), fps, tps)
            text = "".join(f"<{t:.1f} seconds><|vision_start|>{VIDEO_PAD}<|vision_end|>" for t in times[: grid[0]])
            return text, [grid[1] * grid[2] // merge2] * grid[0], grid, None
        seconds = None
        if media.fps:
            sampled_fps = media.num_frames / media.total_frames * media.fps
            seconds = tps / sampled_fps
        return VIDEO_PAD, [grid[0] * grid[1] * grid[2] // merge2], grid, seconds

    def _build(self, sample: ValidSample, text: str, ids: list[int], offsets, media_text) -> TokenizedSample:
        ids_np = np.asarray(ids, dtype=np.int32)
        starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
        ends = np.asarray([o[1] for o in offsets], dtype=np.int64)
        loss = np.zeros(len(ids_np), dtype=np.uint8)
        spans = list(_ASSISTANT_RE.finditer(text))
        if sample.conversation.learn_last is not None:  # earlier assistant turns are context, not targets
            spans = spans[max(0, len(spans) - sample.conversation.learn_last) :]
        for match in spans:
            loss[(starts >= match.start(1)) & (ends <= match.end(1))] = 1
            if not self.reasoning_loss:  # the reasoning block is read, not learned: its answer alone is
                for block in _REASONING_RE.finditer(text, match.start(1), match.end(1)):
                    loss[(starts >= block.start()) & (ends <= block.end())] = 0
        is_pad = _is_pad(ids_np, self.pad_ids)
        loss[is_pad] = 0  # vision tokens are inputs, never targets
        runs = [run for _, media_runs, _, _ in media_text for run in media_runs]
        if int(is_pad.sum()) != len(runs):
            raise ValueError(
                f"sample {sample.index}: {int(is_pad.sum())} pad tokens after tokenization but {len(runs)} vision "
                "runs; the chat template or tokenizer splits Qwen's vision tokens (check its special tokens)"
            )
        out = TokenizedSample(
            index=sample.index, ids=ids_np, loss=loss, runs=np.asarray(runs, dtype=np.int32), media=sample.media
        )
        pad_positions = np.flatnonzero(is_pad)
        run_cursor = 0
        for media, (_, media_runs, grid, seconds) in zip(sample.media, media_text, strict=True):
            first_pad = int(pad_positions[run_cursor])
            run_cursor += len(media_runs)
            (out.image_grids if media.kind == "image" else out.video_grids).append(grid)
            if media.kind == "video" and seconds is not None:
                out.video_second_per_grid.append(seconds)
            out.media_first_token.append(self._media_start(ids_np, first_pad))
        return out

    def _media_start(self, ids: np.ndarray, first_pad: int) -> int:
        """Index of the <|vision_start|> that opens the media whose first pad is at `first_pad`."""
        vision_start = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        before = np.flatnonzero(ids[:first_pad] == vision_start)
        if self.vision.record.video_frames_timestamped and ids[first_pad] == self.pad_ids[1] and len(before) >= 2:
            # A Qwen3-VL video is <|vision_start|><t seconds><|vision_start|>pads...: start at the outer one.
            return int(before[-2])
        return int(before[-1]) if len(before) else first_pad


def _is_pad(ids: np.ndarray, pad_ids: tuple[int, int]) -> np.ndarray:
    # Two comparisons beat np.isin by ~20x on short arrays (it sorts); this runs once per sample per stage.
    return (ids == pad_ids[0]) | (ids == pad_ids[1])


def _replace_pads(rendered: str, replacements: list[str]) -> str:
    """Replace the i-th pad placeholder of the rendered template with the i-th media's text, in order."""
    pieces = iter(replacements)
    try:
        return _PAD_RE.sub(lambda _: next(pieces), rendered)
    except StopIteration:
        raise ValueError("the chat template produced more vision placeholders than the sample has media") from None


def template_switches(tokenizer) -> set[str]:
    """The switches a tokenizer's chat template reads (`enable_thinking`, `reasoning_effort`, `add_vision_id`, ...)."""
    from jinja2 import Environment, meta

    names = meta.find_undeclared_variables(Environment().parse(tokenizer.chat_template))
    return set(names) - _TEMPLATE_INPUTS


def check_template_args(tokenizer, template_args: tuple[tuple[str, Any], ...], where: str) -> None:
    """Refuse a template switch the chat template does not read (it would be silently ignored), naming those it does."""
    known = template_switches(tokenizer)
    unknown = [name for name, _ in template_args if name not in known]
    if unknown:
        raise DataError(
            f"the chat template of {where} does not read {', '.join(map(repr, unknown))}; its switches: "
            f"{', '.join(sorted(known)) or 'none'} (a different template: --chat-template FILE)"
        )


def load_tokenizer(hf_path: pathlib.Path, chat_template: str | None = None):
    """The HF tokenizer in `hf_path` (offline), optionally with a replacement chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer in {hf_path} has no chat template; pass --chat-template FILE")
    missing = [
        t
        for t in (IMAGE_PAD, VIDEO_PAD, "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>")
        if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)
    ]
    if missing:
        raise ValueError(
            f"tokenizer in {hf_path} lacks Qwen-VL special tokens {missing}; use the model's own tokenizer"
        )
    return tokenizer


def truncate(sample: TokenizedSample, seq_length: int, pad_ids: tuple[int, int]) -> TokenizedSample | None:
    """Cut a sample to `seq_length` tokens without splitting a vision block; None if nothing learnable is left."""
    repeats = sample.repeats(pad_ids)
    expanded_end = np.cumsum(repeats)  # expanded position after each compact token
    cut = int(np.searchsorted(expanded_end, seq_length, side="right"))  # compact tokens that fit
    keep_media = 0
    for first in sample.media_first_token:
        media_runs_end = _media_last_token(sample, keep_media, pad_ids)
        if media_runs_end >= cut:
            cut = min(cut, first)
            break
        keep_media += 1
    if not sample.loss[:cut].any():
        return None
    n_runs = int(_is_pad(sample.ids[:cut], pad_ids).sum())
    images = sum(m.kind == "image" for m in sample.media[:keep_media])
    videos = keep_media - images
    return TokenizedSample(
        index=sample.index,
        ids=sample.ids[:cut].copy(),
        loss=sample.loss[:cut].copy(),
        runs=sample.runs[:n_runs].copy(),
        image_grids=sample.image_grids[:images],
        video_grids=sample.video_grids[:videos],
        video_second_per_grid=sample.video_second_per_grid[:videos],
        media_first_token=sample.media_first_token[:keep_media],
        media=sample.media[:keep_media],
    )


def _media_last_token(sample: TokenizedSample, media_index: int, pad_ids: tuple[int, int]) -> int:
    """Compact index of the closing <|vision_end|> of media `media_index`."""
    end = len(sample.ids) - 1
    if media_index + 1 < len(sample.media_first_token):
        end = sample.media_first_token[media_index + 1] - 1
    pads = np.flatnonzero(_is_pad(sample.ids[: end + 1], pad_ids))
    return int(pads[-1]) + 1 if len(pads) else end
