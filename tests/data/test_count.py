"""Token counts must equal what transformers' Qwen-VL processors produce, token for token."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from qvl.data.count import TokenCounter, truncate
from qvl.data.ingest import Conversation, IngestConfig, to_conversation
from qvl.data.validate import ValidateConfig, validate_sample
from qvl.data.vision import image_grid_thw, load_vision_config, smart_resize_video_qwen3
from qvl.foundation.families import get_family

from .conftest import FAMILIES, reference_processor, save_image

# Many shapes: tiny, thin, square, odd, beyond max_pixels, below min_pixels.
SIZES = [
    (1, 1),
    (3, 7),
    (27, 29),
    (28, 28),
    (56, 56),
    (57, 111),
    (100, 37),
    (37, 100),
    (224, 224),
    (640, 480),
    (480, 640),
    (1000, 5),
    (5, 999),
    (333, 777),
    (1023, 17),
    (64, 64),
    (65, 63),
    (129, 257),
    (300, 2),
    (2, 300),
    (799, 601),
    (112, 448),
    (448, 112),
    (50, 9000),
]


def _grid_reference(hf_path: pathlib.Path, sizes: list[tuple[int, int]]) -> list[list[int]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf_path))
    images = [Image.new("RGB", (w, h), (h % 255, w % 255, 7)) for h, w in sizes]
    return processor(images=images)["image_grid_thw"].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_image_grid_equals_image_processor(family, hf_paths):
    config = load_vision_config(hf_paths[family], family)
    sizes = [s for s in SIZES if max(s) / min(s) <= 200]
    assert [list(image_grid_thw(h, w, config)) for h, w in sizes] == _grid_reference(hf_paths[family], sizes)


def test_vision_config_reads_legacy_min_max_pixels_like_transformers(tmp_path, hf_paths):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((hf_paths["qwen2_5_vl"] / "preprocessor_config.json").read_text())
    cfg.update(min_pixels=4 * 28 * 28, max_pixels=20 * 28 * 28)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    ours = load_vision_config(tmp_path, "qwen2_5_vl")
    theirs = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size.shortest_edge, theirs.size.longest_edge)
    assert (ours.patch_size, ours.merge_size) == (theirs.patch_size, theirs.merge_size)
    sizes = [(500, 400), (20, 30), (90, 900)]
    assert [list(image_grid_thw(h, w, ours)) for h, w in sizes] == _grid_reference(tmp_path, sizes)
    assert load_vision_config(tmp_path, "qwen2_5_vl", max_pixels=28 * 28 * 4).max_pixels == 28 * 28 * 4


def _conversation(index: int, turns: list[tuple[str, str]], images: list[str]) -> Conversation:
    record = {"conversations": [{"from": r, "value": v} for r, v in turns], "images": images}
    return to_conversation(index, record, IngestConfig())


def _sample_set(root: pathlib.Path) -> list[tuple[list[tuple[str, str]], list[tuple[int, int]]]]:
    return [
        ([("human", "<image>\nWhat is this?"), ("gpt", "A cat.")], [(77, 123)]),
        (
            [
                ("system", "Be brief."),
                ("human", "Compare <image> and <image>."),
                ("gpt", "Same."),
                ("human", "And now <image>?"),
                ("gpt", "Different: 3 objects!"),
            ],
            [(640, 480), (30, 31), (1000, 20)],
        ),
        ([("human", "No picture here, only text ünïcödé 中文."), ("gpt", "Fine.")], []),
        ([("human", "<image><image><image>"), ("gpt", "Three.")], [(224, 224), (5, 300), (333, 777)]),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_ids_equal_processor(family, hf_paths, tokenizers, tmp_path, monkeypatch):
    vision = load_vision_config(hf_paths[family], family)
    counter = TokenCounter(tokenizer=tokenizers[family], vision=vision)
    processor = reference_processor(family, hf_paths[family], tokenizers[family], monkeypatch)
    valid, pil_images = [], []
    for index, (turns, sizes) in enumerate(_sample_set(tmp_path)):
        names = [save_image(tmp_path / f"{index}_{k}.png", w, h, seed=k).name for k, (h, w) in enumerate(sizes)]
        sample = validate_sample(_conversation(index, turns, names), ValidateConfig(media_root=tmp_path, vision=vision))
        valid.append(sample)
        pil_images.append([Image.open(tmp_path / n).convert("RGB") for n in names])
    for sample, tokenized, images in zip(valid, counter.count(valid), pil_images, strict=True):
        text = tokenizers[family].apply_chat_template(sample.conversation.messages, tokenize=False)
        reference = processor(text=[text], images=images or None)
        ids, loss = tokenized.expand(counter.pad_ids)
        assert ids.tolist() == list(reference["input_ids"][0])
        assert tokenized.length == len(ids)
        if images:
            assert [list(g) for g in tokenized.image_grids] == reference["image_grid_thw"].tolist()
        assert (ids[loss.astype(bool)] != counter.pad_ids[0]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_only_on_assistant_content_and_im_end(family, hf_paths, tokenizers, tmp_path):
    vision = load_vision_config(hf_paths[family], family)
    counter = TokenCounter(tokenizer=tokenizers[family], vision=vision)
    conversation = _conversation(0, [("human", "Q1?"), ("gpt", "A one."), ("human", "Q2?"), ("gpt", "A two.")], [])
    tokenized = counter.count([validate_sample(conversation, ValidateConfig(media_root=tmp_path, vision=vision))])[0]
    ids, loss = tokenized.expand(counter.pad_ids)
    learned = tokenizers[family].decode(ids[loss.astype(bool)].tolist())
    # Qwen3.5's template gives the answer after the last question an (empty) reasoning block, learned with it
    last = "<think>\n\n</think>\n\n" if "<think>" in tokenizers[family].chat_template else ""
    assert learned == f"A one.<|im_end|>{last}A two.<|im_end|>"


def _frame_folder(root: pathlib.Path, frames: int, width: int, height: int) -> str:
    for k in range(frames):
        save_image(root / "clip" / f"{k:04d}.jpg", width, height, seed=k)
    return "clip"


@pytest.mark.parametrize(
    "family,frames,size",
    [
        ("qwen3_vl", 5, (70, 90)),
        ("qwen3_vl", 4, (200, 40)),
        ("qwen3_5_vl", 5, (70, 90)),
        ("qwen2_5_vl", 3, (60, 90)),
        ("qwen2_vl", 6, (120, 50)),
    ],
)
def test_video_frame_folder_tokens_equal_processor_layout(
    family, frames, size, hf_paths, tokenizers, tmp_path, monkeypatch
):
    """Video grid from transformers' own smart_resize, placeholder text from the real processor's replace_video_token."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_qwen3
    from transformers.video_utils import VideoMetadata

    height, width = size
    vision = load_vision_config(hf_paths[family], family)
    record = {
        "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Noise."}],
        "video": _frame_folder(tmp_path, frames, width, height),
        "fps": 2.0,
    }
    sample = validate_sample(
        to_conversation(0, record, IngestConfig()), ValidateConfig(media_root=tmp_path, vision=vision)
    )
    counter = TokenCounter(tokenizer=tokenizers[family], vision=vision)
    tokenized = counter.count([sample])[0]

    factor = vision.video_patch_size * vision.merge_size
    if get_family(family).video_frames_timestamped:  # Qwen3VLVideoProcessor: one budget per clip
        rh, rw = smart_resize_qwen3(frames, height, width, 2, factor, vision.video_min_pixels, vision.video_max_pixels)
    else:
        rh, rw = smart_resize(height, width, factor, vision.video_min_pixels, vision.video_max_pixels)
    grid = [-(-frames // 2), rh // vision.video_patch_size, rw // vision.video_patch_size]
    assert list(tokenized.video_grids[0]) == grid
    processor = reference_processor(family, hf_paths[family], tokenizers[family], monkeypatch)
    video_inputs = {
        "video_grid_thw": torch.tensor([grid]),
        "video_metadata": [VideoMetadata(total_num_frames=frames, fps=2.0, frames_indices=list(range(frames)))],
    }
    text = tokenizers[family].apply_chat_template(sample.conversation.messages, tokenize=False)
    expanded, _ = processor.get_text_with_replacements([text], [], [processor.replace_video_token(video_inputs, 0)])
    reference = tokenizers[family](expanded[0], add_special_tokens=False)["input_ids"]
    ids, _ = tokenized.expand(counter.pad_ids)
    assert ids.tolist() == reference
    if family == "qwen2_5_vl":
        assert tokenized.video_second_per_grid == [2 / 2.0]


def test_qwen3_video_smart_resize_equals_transformers():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    rng = np.random.default_rng(0)
    for _ in range(300):
        t, h, w = int(rng.integers(1, 64)), int(rng.integers(32, 3000)), int(rng.integers(32, 3000))
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize_video_qwen3(t, h, w, 2, 32, 128 * 32 * 32, 32 * 32 * 768) == smart_resize(
            t, h, w, 2, 32, 128 * 32 * 32, 32 * 32 * 768
        )


def test_truncate_keeps_whole_images_and_learnable_tokens(hf_paths, tokenizers, tmp_path):
    vision = load_vision_config(hf_paths["qwen2_5_vl"], "qwen2_5_vl")
    counter = TokenCounter(tokenizer=tokenizers["qwen2_5_vl"], vision=vision)
    names = [save_image(tmp_path / f"{k}.png", 200, 200, seed=k).name for k in range(2)]
    conversation = _conversation(
        0, [("human", "<image>Look."), ("gpt", "Ok " * 30), ("human", "<image>Again?"), ("gpt", "Yes " * 30)], names
    )
    full = counter.count([validate_sample(conversation, ValidateConfig(media_root=tmp_path, vision=vision))])[0]
    image_tokens = int(full.runs[0])
    cut = truncate(full, full.length - 10, counter.pad_ids)
    assert cut is not None and cut.length <= full.length - 10
    assert len(cut.image_grids) == int(np.isin(cut.ids, counter.pad_ids).sum())
    first_image_end = full.media_first_token[0] + 3 + image_tokens
    assert truncate(full, first_image_end - 5, counter.pad_ids) is None  # nothing learnable before the image ends
