"""The preference pairs that ship with qvl: questions about generated images, in each input format qvl reads.

Each image is a coloured shape (qvl.data.samples.draw_shape); the chosen answer names its colour and shape, the
rejected one gets one of them wrong, so a tiny model's reward accuracy can rise within a few steps. Some prompts
have an earlier question and answer (multi-turn), some two images; a few pairs are broken on purpose and end in
quarantine, each with its reason (`bad_pair_reasons(format)`, in the order they follow the good pairs).

    python -m qvl.data.preference_samples --format trl --output .demo/pairs
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from qvl.data.samples import COLOURS, SHAPES, SIZES, draw_shape

logger = logging.getLogger(__name__)

FORMATS = ("trl", "rlaif-v", "ms-swift", "llama-factory")
# Broken pairs, in the order they follow the good ones, and the formats that can spell each.
_BAD = (
    ("pair_identical", FORMATS),
    ("pair_missing_side", FORMATS),
    ("pair_too_long", FORMATS),
    ("image_missing", FORMATS),
    ("not_a_pair", FORMATS),
    ("pair_media_differ", ("ms-swift",)),  # only ms-swift lists images per side (rejected_images)
    ("pair_prompt_differ", ("ms-swift",)),  # only ms-swift spells the rejected side's prompt out (rejected_messages)
)
_LONG = "The picture shows a shape drawn on a plain grey background, in one colour. " * 8
_PLACEHOLDER = re.compile(r"(<image>)")


@dataclass(kw_only=True, slots=True)
class _Spec:
    """One pair, format-neutral: the prompt's turns as (role, text with <image> placeholders), both answers."""

    prompt: list[tuple[str, str]]
    chosen: str
    rejected: str
    images: list[str]
    extra: dict = field(default_factory=dict)  # format-specific changes for a broken pair


def bad_pair_reasons(format: str) -> list[str]:
    """The quarantine reasons of the broken pairs `write_preference_samples(format=...)` appends, in order."""
    return [reason for reason, formats in _BAD if format in formats]


def _good(rng: random.Random, index: int, media: Path) -> _Spec:
    shape, colour = rng.choice(SHAPES), rng.choice(tuple(COLOURS))
    if index % 2:  # the rejected answer gets the colour wrong, else the shape
        wrong = f"A {rng.choice([c for c in COLOURS if c != colour])} {shape}."
    else:
        wrong = f"A {colour} {rng.choice([s for s in SHAPES if s != shape])}."
    name = f"pair_{index:03d}.png"
    draw_shape(shape, colour, rng.choice(SIZES)).save(media / name)
    if index % 7 == 3:  # two images; the question is about the second
        first = f"pair_{index:03d}_a.png"
        draw_shape(rng.choice(SHAPES), rng.choice(tuple(COLOURS)), rng.choice(SIZES)).save(media / first)
        return _Spec(
            prompt=[("user", "<image>\n<image>\nWhat is in the second picture?")],
            chosen=f"A {colour} {shape}.",
            rejected=wrong,
            images=[first, name],
        )
    if index % 5 == 1:  # an earlier question and answer: context, not learned
        prompt = [
            ("user", "<image>\nIs there a shape in the picture?"),
            ("assistant", "Yes, there is one shape."),
            ("user", "Which colour and shape is it?"),
        ]
        return _Spec(prompt=prompt, chosen=f"A {colour} {shape}.", rejected=wrong, images=[name])
    return _Spec(
        prompt=[("user", "<image>\nWhat is in the picture?")],
        chosen=f"A {colour} {shape}.",
        rejected=wrong,
        images=[name],
    )


def _bad(reason: str, media: Path) -> _Spec:
    draw_shape("circle", "red", SIZES[0]).save(media / "bad.png")
    draw_shape("square", "blue", SIZES[0]).save(media / "bad_other.png")
    spec = _Spec(
        prompt=[("user", "<image>\nWhat is in the picture?")],
        chosen="A red circle.",
        rejected="A blue circle.",
        images=["bad.png"],
    )
    if reason == "pair_identical":
        spec.rejected = spec.chosen
    elif reason == "pair_missing_side":
        spec.rejected = ""
    elif reason == "pair_too_long":
        spec.chosen, spec.rejected = "A red circle. " + _LONG, "A blue circle. " + _LONG
    elif reason == "image_missing":
        spec.images = ["does_not_exist.png"]
    elif reason == "pair_media_differ":
        spec.extra = {"rejected_images": ["bad_other.png"]}
    elif reason == "pair_prompt_differ":
        spec.extra = {"rejected_prompt": "<image>\nWhat colour is the background?"}
    return spec


def _parts(text: str) -> list[dict]:
    """Text with <image> placeholders as TRL's content parts."""
    pieces = (p for p in _PLACEHOLDER.split(text) if p)
    return [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in pieces]


def _record(spec: _Spec, format: str, sft: bool) -> dict:
    """The pair in `format`'s spelling (`sft`: only its chosen side, as an SFT record would be)."""
    if format == "trl":
        prompt = [{"role": role, "content": _parts(text)} for role, text in spec.prompt]
        record = {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": spec.chosen}]}],
        }
        record["rejected"] = (
            [{"role": "assistant", "content": [{"type": "text", "text": spec.rejected}]}] if spec.rejected else []
        )
        if sft:
            record = {"messages": [*prompt, *record["chosen"]]}
        return {**record, "images": spec.images}
    if format == "rlaif-v":  # one question, its images before the text (RLAIF-V's questions carry no placeholder)
        question = spec.prompt[-1][1].replace("<image>\n", "")
        if sft:
            return {
                "conversations": [
                    {"from": "human", "value": spec.prompt[-1][1]},
                    {"from": "gpt", "value": spec.chosen},
                ],
                "image": spec.images,
            }
        image = spec.images[0] if len(spec.images) == 1 else spec.images
        return {"question": question, "chosen": spec.chosen, "rejected": spec.rejected, "image": image}
    if format == "ms-swift":
        messages = [{"role": role, "content": text} for role, text in [*spec.prompt, ("assistant", spec.chosen)]]
        record = {"messages": messages, "images": spec.images}
        if sft:
            return record
        if "rejected_prompt" in spec.extra:
            rejected = [
                {"role": "user", "content": spec.extra["rejected_prompt"]},
                {"role": "assistant", "content": spec.rejected},
            ]
            return {**record, "rejected_messages": rejected}
        return {**record, "rejected_response": spec.rejected, **spec.extra}
    roles = {"user": "human", "assistant": "gpt"}
    conversations = [{"from": roles[role], "value": text} for role, text in spec.prompt]
    if sft:
        return {"conversations": [*conversations, {"from": "gpt", "value": spec.chosen}], "images": spec.images}
    chosen, rejected = ({"from": "gpt", "value": text} for text in (spec.chosen, spec.rejected))
    return {"conversations": conversations, "chosen": chosen, "rejected": rejected, "images": spec.images}


def write_preference_samples(
    out_dir: Path, *, format: str = "trl", count: int = 24, seed: int = 0, with_bad: bool = True
) -> tuple[Path, Path]:
    """Write `count` preference pairs (plus the broken ones) in `format` as JSONL with their images; returns
    (jsonl, media_root). The same seed gives the same pairs in every format."""
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    media = out_dir / "images"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = [_record(_good(rng, i, media), format, sft=False) for i in range(count)]
    if with_bad:
        records += [
            _record(_bad(reason, media), format, sft=reason == "not_a_pair") for reason in bad_pair_reasons(format)
        ]
    path = out_dir / f"pairs-{format}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, media


def main(argv: list[str] | None = None) -> int:
    """`python -m qvl.data.preference_samples`: write the sample pairs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=FORMATS, default="trl")
    parser.add_argument("--output", type=Path, required=True, help="folder for the JSONL and its images/")
    parser.add_argument("--count", type=int, default=24, help="good pairs (the broken ones follow)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path, media = write_preference_samples(args.output, format=args.format, count=args.count)
    logger.info("wrote %s (media: %s)", path, media)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
