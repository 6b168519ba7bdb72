"""The parity sample set: a handful of conversations that exercise every part of a training step.

Multi-turn with several images and a system prompt, a text-only conversation, a video (a frame folder with its
frame rate) and a short single-image question; `qvl data prepare` packs them offline like a user's data.
"""

from __future__ import annotations

import json
from pathlib import Path

from qvl.data.samples import draw_shape

VIDEO_FRAMES = 4
VIDEO_FPS = 2.0

RECORDS = (
    {
        "id": "multi-turn-two-images",
        "image": ["red_circle.png", "blue_square.png"],
        "conversations": [
            {"from": "system", "value": "Answer briefly."},
            {"from": "human", "value": "<image>\nWhat is in the picture?"},
            {"from": "gpt", "value": "A red circle."},
            {"from": "human", "value": "What colour is it?"},
            {"from": "gpt", "value": "It is red."},
            {"from": "human", "value": "<image>\nAnd this one?"},
            {"from": "gpt", "value": "A blue square."},
        ],
    },
    {
        "id": "text-only",
        "conversations": [
            {"from": "human", "value": "How many objects are there?"},
            {"from": "gpt", "value": "There are 3 objects."},
            {"from": "human", "value": "Which one is the largest?"},
            {"from": "gpt", "value": "The red one."},
        ],
    },
    {
        "id": "video",
        "video": "clip",
        "fps": VIDEO_FPS,
        "conversations": [
            {"from": "human", "value": "<video>\nWhat moves?"},
            {"from": "gpt", "value": "A green triangle moves."},
        ],
    },
    {
        "id": "one-image",
        "image": "yellow_triangle.png",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": "A yellow triangle on a white background."},
        ],
    },
)


def write_parity_samples(out_dir: Path) -> tuple[Path, Path]:
    """Write the parity conversations as JSONL with their images and video frames; returns (jsonl, media_root)."""
    media = Path(out_dir) / "media"
    (media / "clip").mkdir(parents=True, exist_ok=True)
    draw_shape("circle", "red", (84, 56)).save(media / "red_circle.png")
    draw_shape("square", "blue", (56, 112)).save(media / "blue_square.png")
    draw_shape("triangle", "yellow", (112, 84)).save(media / "yellow_triangle.png")
    for frame in range(VIDEO_FRAMES):  # the triangle drifts right, one frame at a time
        image = draw_shape("triangle", "green", (64, 64))
        image.transform(image.size, 0, (-4 * frame, 0, 0, 0, 1, 0)).save(media / "clip" / f"{frame:03d}.png")
    path = Path(out_dir) / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path, media


def prepare_parity_dataset(hf_path: Path, family: str, out_dir: Path, *, seq_length: int) -> Path:
    """The parity samples packed by `qvl data prepare` (one process) into `out_dir`/data; returns that folder."""
    from qvl.data.prepare import PrepareConfig, prepare

    jsonl, media = write_parity_samples(Path(out_dir) / "samples")
    output = Path(out_dir) / "data"
    prepare(
        PrepareConfig(
            input=jsonl, media_root=media, family=family, hf_path=Path(hf_path), seq_length=seq_length, output=output
        )
    )
    return output
