"""Preference pairs: TRL, RLAIF-V, ms-swift and LLaMA-Factory records as one canonical pair of Conversations.

A pair is two Conversations, prompt + chosen completion and prompt + rejected completion, sharing the prompt and its
media; each side's `learn_last` is the number of final assistant turns that form its completion, so only those are
learned (qvl.data.count) and a multi-turn prompt's earlier answers are context. Records read:

- TRL conversational: `prompt`, `chosen`, `rejected` message lists (content text, or parts with {"type": "image"}),
  media in `images` (trl-lib/rlaif-v); also TRL's standard form (strings) and its implicit-prompt form (no `prompt`:
  `chosen` and `rejected` are whole conversations, each ending with its answer);
- RLAIF-V raw: `question`, `chosen`, `rejected` strings, `image`; a question without `<image>` gets its image(s)
  before the text;
- ms-swift: `messages` ending with the chosen assistant turn, plus `rejected_response` (text) or `rejected_messages`
  (a whole conversation; `rejected_images` when its images are listed apart);
- LLaMA-Factory sharegpt ranking: `conversations` ending with a human turn, `chosen` and `rejected` each a
  {"from": "gpt", "value": ...} turn, media in `images`, an optional `system` text.

What only pairs can get wrong becomes a Rejection with one of PAIR_REASONS; each side also meets every SFT check.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass

import numpy as np

from qvl.data.count import TokenCounter, TokenizedSample
from qvl.data.ingest import (
    ROLE_ALIASES,
    Conversation,
    IngestConfig,
    Rejection,
    iter_record_texts,
    listed_media,
    parse_record,
    to_conversation,
)
from qvl.data.validate import ValidateConfig, ValidSample, validate_sample
from qvl.foundation.errors import DataError

# Keys that make a record a preference pair; an SFT dataset quarantines such a record (`preference_record`)
# instead of training its chosen side alone.
PREFERENCE_KEYS = ("chosen", "rejected", "rejected_response", "rejected_messages", "rejected_images")
PAIR_REASONS = (
    "not_a_pair",  # an SFT record in a preference dataset
    "pair_missing_side",  # chosen or rejected absent or empty
    "pair_prompt_differ",  # a format that spells both sides out in full, with two different prompts
    "pair_media_differ",  # the sides' images or videos differ (ms-swift `rejected_images` != `images`)
    "pair_identical",  # chosen == rejected
    "pair_too_long",  # chosen + rejected tokens > seq_length (both sides go into one pack)
)
KINDS = ("auto", "sft", "preference")  # --kind: "auto" decides by the input's first parseable record
_MEDIA_KEYS = ("image", "images", "video", "videos", "fps")


@dataclass(kw_only=True, slots=True)
class PreferencePair:
    """A preference record in canonical form: both sides as Conversations with the same prompt and media."""

    index: int
    chosen: Conversation  # prompt + chosen completion; learn_last = the completion's assistant turns
    rejected: Conversation


@dataclass(kw_only=True, slots=True)
class _Sides:
    """A record's turns cut into prompt and completions, before canonicalisation (turns as the format spells them)."""

    prompt: list
    chosen: list
    rejected: list
    media: dict  # the record's media keys, for to_conversation
    rejected_media: dict | None = None  # media listed for the rejected side alone
    rejected_prompt: list | None = None  # the rejected side's own prompt, where the format repeats it


def preference_keys(record: dict) -> list[str]:
    """The keys that make `record` a preference pair (none for an SFT record)."""
    return [key for key in PREFERENCE_KEYS if key in record]


def to_pair(index: int, record: dict, config: IngestConfig) -> PreferencePair | Rejection:
    """Normalise one preference record (any format above) into a PreferencePair, or the Rejection that says why not."""
    if not preference_keys(record):
        detail = "no 'chosen'/'rejected' (or ms-swift 'rejected_response'): an SFT record; prepare it with --kind sft"
        return Rejection(index=index, reason="not_a_pair", detail=detail)
    sides = _sides(record)
    if isinstance(sides, str):
        return Rejection(index=index, reason="bad_format", detail=sides)
    for name, turns in (("chosen", sides.chosen), ("rejected", sides.rejected)):
        if not any(_has_text(turn) for turn in turns):
            return Rejection(index=index, reason="pair_missing_side", detail=f"the {name} side is absent or empty")
    conversations = []
    for name, prompt, completion, media in (
        ("chosen", sides.prompt, sides.chosen, sides.media),
        ("rejected", _or(sides.rejected_prompt, sides.prompt), sides.rejected, _or(sides.rejected_media, sides.media)),
    ):
        side = to_conversation(index, {"messages": [*prompt, *completion], **media}, config)
        if isinstance(side, Rejection):
            return dataclasses.replace(side, detail=f"{name} side: {side.detail}")
        side.learn_last = sum(_role(turn) == "assistant" for turn in completion)
        conversations.append((side, len(completion)))
    return _check_pair(index, *conversations)


def _or(value, default):
    return default if value is None else value


def _check_pair(index: int, chosen: tuple[Conversation, int], rejected: tuple[Conversation, int]):
    (chosen, n_chosen), (rejected, n_rejected) = chosen, rejected
    if chosen.messages[:-n_chosen] != rejected.messages[:-n_rejected]:
        detail = "the chosen and rejected conversations have different prompts; a pair shares its prompt"
        return Rejection(index=index, reason="pair_prompt_differ", detail=detail)
    media = [_media_key(side) for side in (chosen, rejected)]
    if media[0] != media[1]:
        detail = f"chosen side's media {media[0]} != rejected side's {media[1]}; a pair shares its images and videos"
        return Rejection(index=index, reason="pair_media_differ", detail=detail)
    if chosen.messages == rejected.messages:
        detail = f"chosen and rejected are the same: {_text(chosen.messages[-1])[:80]!r}"
        return Rejection(index=index, reason="pair_identical", detail=detail)
    return PreferencePair(index=index, chosen=chosen, rejected=rejected)


def _media_key(side: Conversation) -> list[str]:
    """The side's media as `kind:path` in order, and any listed but not placed (placeholder counts differ)."""
    placed = [f"{m.kind}:{m.path}" for m in side.media]
    unplaced = [f"{k}s listed: {n}" for k, n in side.listed_counts.items() if n != side.placeholder_counts.get(k, 0)]
    return placed + unplaced


def _text(message: dict) -> str:
    return "".join(part.get("text", "") for part in message["content"])


def _sides(record: dict) -> _Sides | str:
    """The record's prompt and completions by its format, or what is wrong with its shape."""
    media = {key: record[key] for key in _MEDIA_KEYS if key in record}
    if any(key in record for key in ("messages", "rejected_response", "rejected_messages")):
        return _swift(record, media)
    if "question" in record:
        return _rlaif_v(record, media)
    if "prompt" in record:
        prompt = _turns(record["prompt"], "user", "prompt")
        if isinstance(prompt, str):
            return prompt
        return _completions(record, "chosen", "rejected", prompt, media)
    if "conversations" in record:
        prompt = _turns(record["conversations"], "user", "conversations")
        if isinstance(prompt, str):
            return prompt
        system = record.get("system")
        if isinstance(system, str) and system.strip():  # LLaMA-Factory's system column
            prompt = [{"role": "system", "content": system}, *prompt]
        return _completions(record, "chosen", "rejected", prompt, media)
    # TRL's implicit prompt: `chosen` and `rejected` are whole conversations ending with their answers.
    chosen, rejected = (_turns(record.get(key), "assistant", key) for key in ("chosen", "rejected"))
    if isinstance(chosen, str) or isinstance(rejected, str):
        return chosen if isinstance(chosen, str) else rejected
    prompt, chosen = _split_answer(chosen)
    rejected_prompt, rejected = _split_answer(rejected)
    return _Sides(prompt=prompt, chosen=chosen, rejected=rejected, media=media, rejected_prompt=rejected_prompt)


def _completions(record: dict, chosen_key: str, rejected_key: str, prompt: list, media: dict) -> _Sides | str:
    chosen, rejected = (_turns(record.get(key), "assistant", key) for key in (chosen_key, rejected_key))
    if isinstance(chosen, str) or isinstance(rejected, str):
        return chosen if isinstance(chosen, str) else rejected
    return _Sides(prompt=prompt, chosen=chosen, rejected=rejected, media=media)


def _swift(record: dict, media: dict) -> _Sides | str:
    messages = _turns(record.get("messages"), "user", "messages")
    if isinstance(messages, str):
        return messages
    prompt, chosen = _split_answer(messages)
    sides = _Sides(prompt=prompt, chosen=chosen, rejected=[], media=media)
    if "rejected_messages" in record:
        rejected = _turns(record["rejected_messages"], "assistant", "rejected_messages")
        if isinstance(rejected, str):
            return rejected
        sides.rejected_prompt, sides.rejected = _split_answer(rejected)
    else:
        rejected = _turns(record.get("rejected_response"), "assistant", "rejected_response")
        if isinstance(rejected, str):
            return rejected
        sides.rejected = rejected
    if "rejected_images" in record:
        sides.rejected_media = {
            **{k: v for k, v in media.items() if k not in ("image", "images")},
            "images": record["rejected_images"],
        }
    return sides


def _rlaif_v(record: dict, media: dict) -> _Sides | str:
    question = record["question"]
    if not isinstance(question, str):
        return f"'question' of type {type(question).__name__} is not text"
    listed = listed_media(record)
    if isinstance(listed, Rejection):
        return listed.detail
    if "<image>" not in question and "<video>" not in question:  # RLAIF-V's questions name no placeholder
        question = "".join(f"<{m.kind}>\n" for m in listed) + question
    return _completions(record, "chosen", "rejected", [{"role": "user", "content": question}], media)


def _turns(value, role: str, key: str) -> list | str:
    """A message list as given; text as one `role` turn; a lone turn as a list; None or "" as no turns."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value.strip() else []
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return value
    return f"'{key}' of type {type(value).__name__} is neither text nor a list of messages"


def _split_answer(turns: list) -> tuple[list, list]:
    """(prompt, [final assistant turn]) of a whole conversation; ([...], []) when it does not end with an answer."""
    if turns and _role(turns[-1]) == "assistant":
        return turns[:-1], turns[-1:]
    return turns, []


def _role(turn) -> str | None:
    role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
    return ROLE_ALIASES.get(role.lower(), role) if isinstance(role, str) else None


def _has_text(turn) -> bool:
    """Whether a completion turn says anything (text, not only media or reasoning)."""
    if not isinstance(turn, dict):
        return True  # not a turn: to_conversation names the problem
    content = turn.get("value", turn.get("content"))
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        texts = (p if isinstance(p, str) else p.get("text") if isinstance(p, dict) else None for p in content)
        return any(isinstance(t, str) and t.strip() for t in texts)
    return content is not None


def validate_pair(pair: PreferencePair, config: ValidateConfig) -> tuple[ValidSample, ValidSample] | Rejection:
    """Check both sides as SFT samples are checked; the shared media are opened once (with the chosen side)."""
    chosen = validate_sample(pair.chosen, config)
    if isinstance(chosen, Rejection):
        return dataclasses.replace(chosen, detail=f"chosen side: {chosen.detail}")
    # The rejected side's media are the chosen side's (_check_pair): check its text and roles only.
    rejected = validate_sample(dataclasses.replace(pair.rejected, media=[]), config)
    if isinstance(rejected, Rejection):
        return dataclasses.replace(rejected, detail=f"rejected side: {rejected.detail}")
    return chosen, ValidSample(conversation=pair.rejected, media=chosen.media)


def count_pairs(
    pairs: list[tuple[ValidSample, ValidSample]], counter: TokenCounter, seq_length: int, rejections: list
) -> list[list[TokenizedSample]]:
    """Count both sides of each pair; a pair longer than `seq_length` in all goes to `rejections` (pair_too_long)."""
    sides = counter.count([side for pair in pairs for side in pair])
    kept = []
    for chosen, rejected in zip(sides[::2], sides[1::2], strict=True):
        total = chosen.length + rejected.length
        if total > seq_length:
            detail = (
                f"chosen {chosen.length} + rejected {rejected.length} = {total} tokens > seq_length {seq_length} "
                "(both sides go into one pack)"
            )
            rejections.append(Rejection(index=chosen.index, reason="pair_too_long", detail=detail))
        else:
            kept.append([chosen, rejected])
    return kept


# --- the driver's side: which kind a dataset is, and its packs.jsonl rows ----------------------------------


def resolve_kind(path: pathlib.Path, kind: str) -> str:
    """ "sft" or "preference": `kind` itself, or for "auto" what the input's first parseable record is."""
    if kind not in KINDS:
        raise DataError(f"kind {kind!r} is not one of {', '.join(KINDS)}; pass --kind auto, sft or preference")
    if kind != "auto":
        return kind
    for index, text in iter_record_texts(path):
        record = parse_record(index, text)
        if isinstance(record, dict):
            return "preference" if preference_keys(record) else "sft"
    return "sft"  # nothing parseable: every record is quarantined either way


def pair_pack_row(items: np.ndarray, index: np.ndarray, length: np.ndarray, first_length: np.ndarray) -> dict:
    """A preference pack's packs.jsonl fields: per sub-sequence (chosen, rejected, ...) its source index and length,
    as the pack's json lists them, and its pair count."""
    chosen, rejected = first_length[items], length[items] - first_length[items]
    return {
        "samples": np.repeat(index[items], 2).tolist(),
        "lengths": np.stack([chosen, rejected], axis=1).reshape(-1).tolist(),
        "pairs": len(items),
    }
