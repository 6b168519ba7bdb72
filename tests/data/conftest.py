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

from qvl.data.testing import write_tiny_hf_processor_dir  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """One tiny tokenizer + processor dir per family."""
    root = tmp_path_factory.mktemp("hf")
    return {family: write_tiny_hf_processor_dir(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tokenizers(hf_dirs):
    from qvl.data.count import load_tokenizer

    return {family: load_tokenizer(path) for family, path in hf_dirs.items()}


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


def reference_processor(family: str, hf_dir: pathlib.Path, tokenizer, monkeypatch):
    """transformers' real processor for `family` (no video processor: torchvision is absent here)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class _VideoRules:  # what replace_video_token reads from a video processor
        temporal_patch_size = 2
        merge_size = 2

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf_dir))
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=_VideoRules(),
               chat_template=tokenizer.chat_template)
