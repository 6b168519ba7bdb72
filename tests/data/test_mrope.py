"""3-D mRoPE position ids must equal transformers' get_rope_index for single samples of every family."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from qvl.data.count import TokenCounter
from qvl.data.ingest import IngestConfig, to_conversation
from qvl.data.mrope import RopeConfig, mrope_position_ids, packed_position_ids
from qvl.data.validate import ValidateConfig, validate_sample
from qvl.data.vision import load_vision_config

from .conftest import save_image

TOKENS_PER_SECOND = 2


def _model_class(family: str):
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as cls
    elif family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as cls
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as cls
    return cls


def _transformers_positions(family, ids, mm_types, image_grids, video_grids, seconds):
    cls = _model_class(family)
    vision_config = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=TOKENS_PER_SECOND)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision_config))
    fake.get_vision_position_ids = lambda *a, **k: cls.get_vision_position_ids(fake, *a, **k)
    kwargs = {}
    if family == "qwen2_5_vl" and seconds:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    positions, _ = cls.get_rope_index(
        fake,
        torch.tensor([ids]),
        torch.tensor([mm_types]),
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
        **kwargs,
    )
    return positions[:, 0].numpy()


def _tokenized(family, hf_paths, tokenizers, tmp_path, fps):
    vision = load_vision_config(hf_paths[family], family)
    for k in range(5):
        save_image(tmp_path / "clip" / f"{k}.png", 90, 70, seed=k)
    for k, (w, h) in enumerate([(200, 120), (40, 300)]):
        save_image(tmp_path / f"i{k}.png", w, h, seed=k)
    record = {
        "conversations": [
            {"from": "human", "value": "<image> then <video> and <image>?"},
            {"from": "gpt", "value": "Yes."},
        ],
        "images": ["i0.png", "i1.png"],
        "video": "clip",
        "fps": fps,
    }
    sample = validate_sample(
        to_conversation(0, record, IngestConfig()), ValidateConfig(media_root=tmp_path, vision=vision)
    )
    counter = TokenCounter(tokenizer=tokenizers[family], vision=vision)
    return counter, counter.count([sample])[0]


@pytest.mark.parametrize("family,fps", [("qwen2_vl", 2.0), ("qwen2_5_vl", 0.5), ("qwen2_5_vl", 2.0), ("qwen3_vl", 2.0)])
def test_positions_equal_transformers_get_rope_index(family, fps, hf_paths, tokenizers, tmp_path):
    counter, tokenized = _tokenized(family, hf_paths, tokenizers, tmp_path, fps)
    ids, _ = tokenized.expand(counter.pad_ids)
    image_pad, video_pad = counter.pad_ids
    config = RopeConfig(
        family=family,
        spatial_merge_size=2,
        image_pad_id=image_pad,
        video_pad_id=video_pad,
        tokens_per_second=TOKENS_PER_SECOND,
    )
    ours = mrope_position_ids(
        ids, tokenized.image_grids, tokenized.video_grids, config, tokenized.video_second_per_grid
    )
    mm_types = np.where(ids == image_pad, 1, np.where(ids == video_pad, 2, 0)).tolist()
    theirs = _transformers_positions(
        family,
        ids.tolist(),
        mm_types,
        [list(g) for g in tokenized.image_grids],
        [list(g) for g in tokenized.video_grids],
        tokenized.video_second_per_grid,
    )
    np.testing.assert_array_equal(ours, theirs)


def test_packed_positions_restart_per_sub_sequence():
    config = RopeConfig(family="qwen2_vl", spatial_merge_size=2, image_pad_id=5, video_pad_id=6)
    a, b = np.array([1, 7, 8, 2]), np.array([1, 3, 5, 5, 5, 5, 4, 9])
    media = [{"image_grid_thw": [], "video_grid_thw": []}, {"image_grid_thw": [[1, 4, 4]], "video_grid_thw": []}]
    packed = packed_position_ids([a, b], media, config)
    assert packed.shape == (3, 12)
    np.testing.assert_array_equal(packed[:, :4], np.tile(np.arange(4), (3, 1)))
    np.testing.assert_array_equal(packed[:, 4:], mrope_position_ids(b, [[1, 4, 4]], [], config))
    assert packed[0, 4] == 0
