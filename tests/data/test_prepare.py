"""End to end: every bad input is quarantined with its reason, every good sample lands in exactly one pack,
and the written dataset loads through Energon into THD batches whose state saves and restores exactly."""

from __future__ import annotations

import json
import pathlib
import tarfile

import numpy as np
import pytest
import torch

from qvl.data.count import IGNORE_INDEX
from qvl.data.prepare import PrepareConfig, prepare
from qvl.data.write import CRUDE_CONFIG

SEQ_LENGTH = 512


@pytest.fixture(scope="module")
def prepared(synthetic_dataset, hf_paths, tmp_path_factory):
    input_path, media_root, expected, good = synthetic_dataset
    output = tmp_path_factory.mktemp("out") / "ds"
    config = PrepareConfig(
        input=input_path,
        media_root=media_root,
        family="qwen2_5_vl",
        hf_path=hf_paths["qwen2_5_vl"],
        seq_length=SEQ_LENGTH,
        output=output,
        packs_per_shard=2,
    )
    report = prepare(config)
    return output, report, expected, good, config


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_bad_input_is_quarantined_with_its_reason(prepared):
    output, report, expected, good, _ = prepared
    quarantine = _jsonl(output / "quarantine.jsonl")
    assert {q["index"]: q["reason"] for q in quarantine} == expected
    assert all(q["detail"] for q in quarantine)
    assert report["read"] == len(expected) + len(good)
    assert report["quarantined"] == len(expected) and report["accepted"] == len(good)
    by_reason = {}
    for reason in expected.values():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    assert report["quarantined_by_reason"] == by_reason


def test_every_good_sample_is_in_exactly_one_pack(prepared):
    output, report, _, good, _ = prepared
    packs = _jsonl(output / "packs.jsonl")
    placed = [i for p in packs for i in p["samples"]]
    assert sorted(placed) == good
    assert all(sum(p["lengths"]) <= SEQ_LENGTH for p in packs)
    assert report["packed_sequences"] == len(packs)
    total = sum(sum(p["lengths"]) for p in packs)
    assert report["total_tokens"] == total
    assert report["packing_efficiency"] == pytest.approx(total / (len(packs) * SEQ_LENGTH), abs=1e-6)
    assert set(report["time_s"]) == {"validate_count", "pack", "write"}
    assert set(report["worker_cpu_s"]) == {"ingest", "validate", "count"}
    assert (output / ".nv-meta" / "dataset.yaml").is_file() and not pathlib.Path(str(output) + ".partial").exists()


def test_every_pack_records_the_rows_its_images_and_videos_give_the_vision_tower(prepared):
    """packs.jsonl's `vision_rows` (which plan a graphed tower's bucket sizes) are the patches of the grids written
    into each pack's shard: images, then videos."""
    output = prepared[0]
    written = {}
    for shard in sorted(output.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    grids = [
                        [g for sub in meta["subs"] for g in sub[f"{kind}_grid_thw"]] for kind in ("image", "video")
                    ]
                    written[meta["pack"]] = [int(np.prod(g, axis=-1).sum()) if g else 0 for g in grids]
    packs = _jsonl(output / "packs.jsonl")
    assert {p["pack"]: p["vision_rows"] for p in packs} == written
    assert any(rows[0] for rows in written.values()) and any(rows[1] for rows in written.values())


def _encoder(hf_path):
    from qvl.data.encode import QwenVLPackedTaskEncoder

    return QwenVLPackedTaskEncoder(hf_path=hf_path, family="qwen2_5_vl", tokens_per_second=2)


def _dataset(path, encoder, batch_size=1, repeat=True):
    from megatron.energon import WorkerConfig, get_train_dataset

    return get_train_dataset(
        path,
        batch_size=batch_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        task_encoder=encoder,
        repeat=repeat,
        dataset_config=CRUDE_CONFIG,  # qvl's view; dataset.yaml is the typed one for Energon's own tools
    )


def test_energon_epoch_yields_every_pack_once_as_thd_batches(prepared, hf_paths):
    from megatron.energon.savable_loader import BasicDataLoader

    output, _, _, good, _ = prepared
    packs = {tuple(p["samples"]): p for p in _jsonl(output / "packs.jsonl")}
    seen = []
    for batch in BasicDataLoader(
        _dataset(output, _encoder(hf_paths["qwen2_5_vl"]), repeat=False), gc_collect_every_n_steps=0
    ):
        (indices,) = batch.source_indices
        seen.extend(indices)
        lengths = packs[tuple(indices)]["lengths"]
        total = sum(lengths)
        assert batch.tokens.shape == (1, total) and batch.position_ids.shape == (3, 1, total)
        assert batch.cu_seqlens_q.tolist() == np.r_[0, np.cumsum(lengths)].tolist()
        assert batch.labels.shape == batch.tokens.shape
        learned = batch.labels[0] != IGNORE_INDEX
        assert learned.any()
        assert torch.equal(batch.loss_mask[0].bool(), learned)
        ends = batch.cu_seqlens_q[1:] - 1
        assert (batch.labels[0, ends] == IGNORE_INDEX).all()  # no prediction across sub-sequences
        starts = batch.cu_seqlens_q[:-1]
        assert (batch.position_ids[:, 0, starts] == 0).all()  # positions restart per sub-sequence
        n_image_patches = int(batch.image_grid_thw.prod(dim=1).sum())
        assert (0 if batch.pixel_values is None else batch.pixel_values.shape[0]) == n_image_patches
        n_video_patches = int(batch.video_grid_thw.prod(dim=1).sum())
        assert (0 if batch.pixel_values_videos is None else batch.pixel_values_videos.shape[0]) == n_video_patches
        image_tokens = int((batch.tokens == _pad_id(hf_paths)).sum())
        assert image_tokens == n_image_patches // 4
    assert sorted(seen) == good


def _pad_id(hf_paths) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_paths["qwen2_5_vl"])).convert_tokens_to_ids("<|image_pad|>")


def _summary(batch) -> tuple:
    return (
        batch.tokens.tolist(),
        batch.position_ids.tolist(),
        batch.source_indices,
        None if batch.pixel_values is None else float(batch.pixel_values.sum()),
    )


def test_savable_loader_restores_identical_next_batches(prepared, hf_paths):
    from megatron.energon import get_savable_loader

    output = prepared[0]
    encoder = _encoder(hf_paths["qwen2_5_vl"])
    loader = get_savable_loader(_dataset(output, encoder, batch_size=2), gc_collect_every_n_steps=0)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.save_state_rank()
    expected = [_summary(next(iterator)) for _ in range(4)]

    restored = get_savable_loader(_dataset(output, encoder, batch_size=2), gc_collect_every_n_steps=0)
    restored.restore_state_rank(state)
    iterator = iter(restored)
    assert [_summary(next(iterator)) for _ in range(4)] == expected
