"""Fixtures for the data pipeline tests: tiny offline HF tokenizer/processor dirs and synthetic datasets."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from qvl.foundation.families import get_family  # noqa: E402
from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vl")  # Qwen3.5-VL: Qwen3-VL's processor, its own ids


@pytest.fixture(scope="session")
def hf_paths(tmp_path_factory) -> dict[str, pathlib.Path]:
    """One tiny tokenizer + processor dir per family."""
    root = tmp_path_factory.mktemp("hf")
    return {family: write_tiny_hf_processor_dir(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tokenizers(hf_paths):
    from qvl.data.count import load_tokenizer

    return {family: load_tokenizer(path) for family, path in hf_paths.items()}


def save_image(path: pathlib.Path, width: int, height: int, seed: int = 0, fmt: str | None = None) -> pathlib.Path:
    """A random RGB image of width x height saved at `path`."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path, format=fmt)
    return path


def write_jsonl(path: pathlib.Path, records: list) -> pathlib.Path:
    """Write records (dicts, or raw bytes/str lines) as JSONL."""
    with path.open("wb") as f:
        for record in records:
            if isinstance(record, bytes):
                f.write(record + b"\n")
            elif isinstance(record, str):
                f.write(record.encode() + b"\n")
            else:
                f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
    return path


def reference_processor(family: str, hf_path: pathlib.Path, tokenizer, monkeypatch):
    """transformers' real processor for `family` (no video processor: torchvision is absent here)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class _VideoRules:  # what replace_video_token reads from a video processor
        temporal_patch_size = 2
        merge_size = 2

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    cls = {"Qwen2VLProcessor": Qwen2VLProcessor, "Qwen2_5_VLProcessor": Qwen2_5_VLProcessor}.get(
        get_family(family).processor_class, Qwen3VLProcessor
    )
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf_path))
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_VideoRules(),
        chat_template=tokenizer.chat_template,
    )


def _good_records(root: pathlib.Path) -> list[dict]:
    """Well-formed samples: text-only, images of many sizes, multi-image, multi-turn, video folder, OpenAI format."""
    sizes = [(64, 48), (300, 200), (17, 33), (640, 480), (90, 900), (256, 256), (31, 1000), (500, 120)]
    for k, (w, h) in enumerate(sizes):
        save_image(root / "img" / f"{k}.png", w, h, seed=k)
    save_image(root / "img" / "photo.jpg", 333, 222, seed=9, fmt="JPEG")
    for f in range(4):
        save_image(root / "clip" / f"{f:03d}.jpg", 96, 64, seed=f, fmt="JPEG")
    records = [
        {
            "conversations": [
                {"from": "human", "value": "Hello there, who are you?"},
                {"from": "gpt", "value": "An assistant."},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "<image>\nWhat is it?"},
                {"from": "gpt", "value": "A square."},
                {"from": "human", "value": "Color?"},
                {"from": "gpt", "value": "Red."},
            ],
            "image": "img/0.png",
        },
        {
            "conversations": [
                {"from": "human", "value": "<image> vs <image> vs <image>"},
                {"from": "gpt", "value": "Equal."},
            ],
            "images": ["img/1.png", "img/2.png", "img/3.png"],
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "img/4.png"}, {"type": "text", "text": "Tall?"}],
                },
                {"role": "assistant", "content": "Very tall."},
            ]
        },
        {
            "conversations": [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "Nothing."}],
            "video": "clip",
            "fps": 2.0,
        },
        {
            "conversations": [
                {"from": "human", "value": "<image>Photo?"},
                {"from": "gpt", "value": "A photo, 中文 ok."},
            ],
            "image": "img/photo.jpg",
        },
    ]
    for k in (5, 6, 7):
        records.append(
            {
                "conversations": [
                    {"from": "human", "value": f"<image>\nNumber {k}?"},
                    {"from": "gpt", "value": f"It is {k}. " * k},
                ],
                "image": f"img/{k}.png",
            }
        )
    for k in range(12):
        records.append(
            {
                "conversations": [
                    {"from": "human", "value": "Count: " + "1 2 3 " * k},
                    {"from": "gpt", "value": "Done " * (k + 1)},
                ]
            }
        )
    return records


def _bad_records(root: pathlib.Path) -> list[tuple[object, str]]:
    """(record, expected quarantine reason) for every kind of bad input."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    (root / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    good_jpeg = save_image(root / "img" / "full.jpg", 200, 200, seed=3, fmt="JPEG").read_bytes()
    (root / "img" / "truncated.jpg").write_bytes(good_jpeg[: len(good_jpeg) // 2])
    save_image(root / "img" / "thin.png", 1000, 3, seed=1)
    (root / "emptyclip").mkdir(exist_ok=True)

    def conv(human, gpt="Fine.", **extra):
        turns = [{"from": "human", "value": human}] + ([{"from": "gpt", "value": gpt}] if gpt is not None else [])
        return {"conversations": turns, **extra}

    return [
        ("{this is not json", "bad_json"),
        ('{"no_turns": true}', "bad_format"),
        (
            b'{"conversations": [{"from": "human", "value": "bad \xff byte"}, {"from": "gpt", "value": "x"}]}',
            "invalid_utf8",
        ),
        (conv("Say <|im_start|> please"), "special_token_in_text"),
        (conv("Question?", gpt=""), "empty"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "human", "value": "b"},
                    {"from": "gpt", "value": "c"},
                ]
            },
            "bad_roles",
        ),
        (conv("Only a question?", gpt=None), "no_assistant_turn"),
        (conv("<image> and <image>?", image="img/full.jpg"), "placeholder_mismatch"),
        (conv("<image>?", image="img/missing.png"), "image_missing"),
        (conv("<image>?", image="img/broken.png"), "image_undecodable"),
        (conv("<image>?", image="img/truncated.jpg"), "image_undecodable"),
        (conv("<image>?", image="img/thin.png"), "image_unresizable"),
        (conv("<video>?", video="nothing_here"), "video_missing"),
        (conv("<video>?", video="emptyclip", fps=1.0), "video_undecodable"),
        (conv("long " * 900), "too_long"),
    ]


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory):
    """A JSONL with good and bad samples interleaved; returns (input, media_root, {index: reason}, good indices)."""
    root = tmp_path_factory.mktemp("synthetic")
    good, bad = _good_records(root), _bad_records(root)
    records, expected, good_indices = [], {}, []
    for position in range(len(good) + len(bad)):
        if position % 2 and bad:
            record, reason = bad.pop(0)
            expected[len(records)] = reason
            records.append(record)
        elif good:
            good_indices.append(len(records))
            records.append(good.pop(0))
        else:
            record, reason = bad.pop(0)
            expected[len(records)] = reason
            records.append(record)
    return write_jsonl(root / "train.jsonl", records), root, expected, good_indices
