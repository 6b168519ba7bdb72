"""Video files: frames sampled like Qwen3-VL's video processor, tokens laid out like its processor, and loaded."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from qvl.data.count import TokenCounter
from qvl.data.ingest import IngestConfig, to_conversation
from qvl.data.prepare import PrepareConfig, prepare
from qvl.data.validate import ValidateConfig, validate_sample
from qvl.data.vision import load_vision_config
from qvl.data.write import CRUDE_CONFIG

from .conftest import reference_processor, write_jsonl

FRAMES, FPS = 23, 10


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    av = pytest.importorskip("av")
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in range(FRAMES):
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), i * 10, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _record(name: str) -> dict:
    return {
        "conversations": [{"from": "human", "value": "<video>\nWhat changes?"}, {"from": "gpt", "value": "Light."}],
        "video": name,
    }


def test_qwen3_video_file_sampling_and_tokens_equal_transformers(mp4, hf_paths, tokenizers, monkeypatch):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    vision = load_vision_config(hf_paths["qwen3_vl"], "qwen3_vl")
    sample = validate_sample(
        to_conversation(0, _record(mp4.name), IngestConfig()), ValidateConfig(media_root=mp4.parent, vision=vision)
    )
    fake = types.SimpleNamespace(
        fps=vision.video_fps, min_frames=vision.video_min_frames, max_frames=vision.video_max_frames
    )
    expected = Qwen3VLVideoProcessor.sample_frames(fake, VideoMetadata(total_num_frames=FRAMES, fps=FPS))
    assert sample.media[0].frame_indices == expected.tolist()

    counter = TokenCounter(tokenizer=tokenizers["qwen3_vl"], vision=vision)
    tokenized = counter.count([sample])[0]
    processor = reference_processor("qwen3_vl", hf_paths["qwen3_vl"], tokenizers["qwen3_vl"], monkeypatch)
    metadata = VideoMetadata(total_num_frames=FRAMES, fps=FPS, frames_indices=expected.tolist())
    video_inputs = {"video_grid_thw": torch.tensor([list(tokenized.video_grids[0])]), "video_metadata": [metadata]}
    text = tokenizers["qwen3_vl"].apply_chat_template(sample.conversation.messages, tokenize=False)
    expanded, _ = processor.get_text_with_replacements([text], [], [processor.replace_video_token(video_inputs, 0)])
    ids, _ = tokenized.expand(counter.pad_ids)
    assert ids.tolist() == tokenizers["qwen3_vl"](expanded[0], add_special_tokens=False)["input_ids"]


def test_video_file_pack_loads_with_video_patches(mp4, hf_paths, tmp_path):
    from megatron.energon import WorkerConfig, get_train_dataset
    from megatron.energon.savable_loader import BasicDataLoader

    from qvl.data.encode import QwenVLPackedTaskEncoder

    input_path = write_jsonl(tmp_path / "in.jsonl", [_record(mp4.name)])
    output = tmp_path / "ds"
    prepare(
        PrepareConfig(
            input=input_path,
            media_root=mp4.parent,
            family="qwen3_vl",
            hf_path=hf_paths["qwen3_vl"],
            seq_length=1024,
            output=output,
        )
    )
    encoder = QwenVLPackedTaskEncoder(hf_path=hf_paths["qwen3_vl"], family="qwen3_vl")
    dataset = get_train_dataset(
        output,
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        task_encoder=encoder,
        repeat=False,
        dataset_config=CRUDE_CONFIG,  # qvl's view; dataset.yaml is the typed one for Energon's own tools
    )
    (batch,) = list(BasicDataLoader(dataset, gc_collect_every_n_steps=0))
    t, h, w = batch.video_grid_thw[0].tolist()
    assert batch.pixel_values_videos.shape == (t * h * w, 3 * 2 * 16 * 16)
    assert int((batch.tokens == encoder.rope.video_pad_id).sum()) == t * h * w // 4
