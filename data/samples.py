"""The sample dataset that ships with qvl: a few dozen LLaVA-style conversations about generated images.

Each image is a coloured shape on a plain background, drawn with PIL at one of several sizes, so the
dynamic-resolution path gets exercised; answers name the shape and colour, which a tiny model can learn
within ~20 steps (its loss visibly falls). Some samples carry two images or two turns; a few are
deliberately bad (missing image, placeholder mismatch, no assistant turn) to show the quarantine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((56, 56), (84, 56), (56, 112), (112, 84))


def draw_shape(shape: str, colour: str, size: tuple[int, int]) -> Image.Image:
    """A `colour` `shape` centred on a light grey background."""
    width, height = size
    image = Image.new("RGB", size, (235, 235, 235))
    draw = ImageDraw.Draw(image)
    box = (width * 0.2, height * 0.2, width * 0.8, height * 0.8)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(width / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    return image


def _conversation(rng: random.Random, index: int, media: Path, reasoning: bool) -> dict:
    shape, colour = rng.choice(SHAPES), rng.choice(tuple(COLOURS))
    name = f"img_{index:03d}.png"
    draw_shape(shape, colour, rng.choice(SIZES)).save(media / name)
    turns = [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": f"A {colour} {shape}."},
    ]
    if reasoning:  # a reasoning trace before the answer, as thinking-model SFT data carries it
        turns[1]["reasoning"] = f"The outline is a {shape}; the fill is {colour}."
    images = [name]
    if index % 5 == 0:  # a second turn about the same image
        turns += [{"from": "human", "value": "What colour is it?"}, {"from": "gpt", "value": f"It is {colour}."}]
    if index % 7 == 0:  # a second image
        other_shape, other_colour = rng.choice(SHAPES), rng.choice(tuple(COLOURS))
        other = f"img_{index:03d}_b.png"
        draw_shape(other_shape, other_colour, rng.choice(SIZES)).save(media / other)
        turns += [
            {"from": "human", "value": "<image>\nAnd this one?"},
            {"from": "gpt", "value": f"A {other_colour} {other_shape}."},
        ]
        images.append(other)
    return {"id": f"sample-{index}", "image": images, "conversations": turns}


# Deliberately broken samples: each must end in quarantine with this reason.
BAD_SAMPLES = (
    (
        {
            "id": "bad-missing-image",
            "image": ["does_not_exist.png"],
            "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Nothing."}],
        },
        "image_missing",
    ),
    (
        {
            "id": "bad-placeholders",
            "image": [],
            "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Nothing."}],
        },
        "placeholder_mismatch",
    ),
    ({"id": "bad-no-answer", "conversations": [{"from": "human", "value": "Hello?"}]}, "no_assistant_turn"),
)


def write_sample_dataset(
    out_dir: Path, *, count: int = 48, seed: int = 0, with_bad: bool = True, reasoning: bool = False
) -> tuple[Path, Path]:
    """Write `count` conversations (plus the bad ones) as JSONL with their images; returns (jsonl, media_root).
    `reasoning`: each first answer comes with a reasoning trace (rendered by reasoning templates, qvl.data.count)."""
    out_dir = Path(out_dir)
    media = out_dir / "images"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    samples = [_conversation(rng, i, media, reasoning) for i in range(count)]
    if with_bad:
        samples += [sample for sample, _ in BAD_SAMPLES]
    path = out_dir / "conversations.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path, media
