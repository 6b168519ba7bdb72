"""The preference loader: batches whose `pairs` name each pair's (chosen, rejected) sub-sequences within the
micro-batch, with each side's reference log-prob and token count from the reference table, through Energon's loader,
the DP-planned loader and the dataset hook; a pack the table lacks, or an SFT pack, fails in one line."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from qvl.data.ingest import IngestConfig
from qvl.data.preference import to_pair
from qvl.data.preference_samples import write_preference_samples
from qvl.data.prepare import PrepareConfig, prepare
from qvl.foundation.errors import DataError

from .test_balance import TINY_CONFIG

FAMILY = "qwen2_5_vl"


@pytest.fixture(scope="module")
def dataset(hf_paths, tmp_path_factory):
    """TRL sample pairs prepared with a DP plan for 2 ranks; a reference table whose log-prob of pack p's sub s is
    -(100 p + s) and token count 10 p + s; returns (output, records, packs.jsonl rows, reference folder)."""
    root = tmp_path_factory.mktemp("pref-encode")
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    jsonl, media = write_preference_samples(root / "samples", format="trl", count=12, with_bad=False)
    output = root / "ds"
    prepare(
        PrepareConfig(
            input=jsonl,
            media_root=media,
            family=FAMILY,
            hf_path=hf_paths[FAMILY],
            seq_length=512,
            output=output,
            data_parallel=2,
            global_batch_size=2,
            model_config=root / "config.json",
        )
    )
    rows = [json.loads(line) for line in (output / "packs.jsonl").read_text().splitlines()]
    pack = np.concatenate([[r["pack"]] * len(r["samples"]) for r in rows])
    sub = np.concatenate([np.arange(len(r["samples"])) for r in rows])
    reference = _write_table(root / "reference", pack, sub)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return output, records, rows, reference


def _write_table(folder, pack, sub):
    folder.mkdir()
    order = np.lexsort((sub, pack))  # sorted by pack, then sub, as qvl.data.reference.write_reference writes it
    pack, sub = pack[order].astype(np.int64), sub[order].astype(np.int64)
    np.savez(folder / "logps.npz", pack=pack, sub=sub, logp=-(100.0 * pack + sub), tokens=10 * pack + sub)
    return folder


def _encoder(hf_paths, reference=None):
    from qvl.data.preference_encode import PreferenceTaskEncoder

    return PreferenceTaskEncoder(hf_path=hf_paths[FAMILY], family=FAMILY, reference=reference, tokens_per_second=2)


def _check_batch(batch, records, tokenizer, with_reference: bool) -> list[int]:
    """Assert what a preference batch says about its pairs; return the source indices of its pairs."""
    from qvl.data.preference_encode import PreferenceBatch

    assert isinstance(batch, PreferenceBatch) and batch.pairs.dtype == torch.int64
    cu = batch.cu_seqlens_q.tolist()
    n_subs = len(cu) - 1
    indices = [i for pack in batch.source_indices for i in pack]
    assert sorted(batch.pairs.reshape(-1).tolist()) == list(range(n_subs))  # every sub-sequence in one pair
    learned = (batch.labels[0] != -100).tolist()
    for chosen, rejected in batch.pairs.tolist():
        assert rejected == chosen + 1 and indices[chosen] == indices[rejected]
        pair = to_pair(indices[chosen], records[indices[chosen]], IngestConfig())
        for sub, side in ((chosen, pair.chosen), (rejected, pair.rejected)):
            # labels are shifted: the token at t + 1 is learned where labels[t] is set
            targets = [batch.tokens[0, t + 1].item() for t in range(cu[sub], cu[sub + 1]) if learned[t]]
            assert tokenizer.decode(targets) == side.messages[-1]["content"][0]["text"] + "<|im_end|>"
    if with_reference:
        assert batch.reference_logps.dtype == torch.float64 and batch.reference_tokens.dtype == torch.int64
        expected = [(p, s) for p, pack in zip(batch.packs, batch.source_indices) for s in range(len(pack))]
        assert batch.reference_logps.tolist() == [-(100.0 * p + s) for p, s in expected]
        assert batch.reference_tokens.tolist() == [10 * p + s for p, s in expected]
    else:
        assert batch.reference_logps is None and batch.reference_tokens is None
    return indices[::2]


@pytest.mark.parametrize("with_reference", [True, False], ids=["reference", "no-reference"])
def test_energon_batches_name_every_pair_and_its_reference(dataset, hf_paths, tokenizers, with_reference):
    from megatron.energon import WorkerConfig, get_train_dataset
    from megatron.energon.savable_loader import BasicDataLoader

    from qvl.data.write import CRUDE_CONFIG

    output, records, _, reference = dataset
    encoder = _encoder(hf_paths, reference if with_reference else None)
    loader = BasicDataLoader(
        get_train_dataset(
            output,
            batch_size=2,  # two packs per micro-batch: the second pack's pairs are offset by the first's subs
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            task_encoder=encoder,
            repeat=False,
            dataset_config=CRUDE_CONFIG,
        ),
        gc_collect_every_n_steps=0,
    )
    seen = []
    for batch in loader:
        seen += _check_batch(batch, records, tokenizers[FAMILY], with_reference)
        assert len(batch.packs) <= 2
    assert sorted(seen) == list(range(12))


def test_the_dataset_hook_serves_each_rank_its_planned_pairs(dataset, hf_paths, tokenizers, monkeypatch):
    from megatron.core import parallel_state

    from qvl.data.load import build_preference_datasets

    output, records, rows, reference = dataset
    config = types.SimpleNamespace(
        path=str(output), hf_path=str(hf_paths[FAMILY]), family=FAMILY, micro_batch_size=1, num_workers=0
    )
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: 2)
    served = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda rank=rank: rank)
        loader, _, _ = build_preference_datasets(types.SimpleNamespace(**vars(config), reference=reference), None)
        planned = sorted((r["step"], r["slot"], r["pack"]) for r in rows if r["rank"] == rank and r["step"] >= 0)
        for _, _, pack in planned:
            batch = next(loader)
            assert batch.packs == [pack]
            served += _check_batch(batch, records, tokenizers[FAMILY], with_reference=True)
    scheduled = [i for r in rows if r["step"] >= 0 for i in r["samples"][::2]]
    assert sorted(served) == sorted(scheduled)
    loader, _, _ = build_preference_datasets(types.SimpleNamespace(**vars(config), reference=None), None)
    assert next(loader).reference_logps is None


def _first_pack(output, rows, encoder):
    from qvl.data.planned import PackMicroBatches

    return PackMicroBatches(output, encoder, [(rows[0]["pack"], rows[0]["shard"])], 1)


def test_a_pack_without_reference_rows_fails_naming_it(dataset, hf_paths, tmp_path):
    output, _, rows, _ = dataset
    others = [r for r in rows if r["pack"] != rows[0]["pack"]]
    pack = np.concatenate([[r["pack"]] * len(r["samples"]) for r in others])
    sub = np.concatenate([np.arange(len(r["samples"])) for r in others])
    encoder = _encoder(hf_paths, _write_table(tmp_path / "partial", pack, sub))
    with pytest.raises(DataError, match=f"no log-probs for pack {rows[0]['pack']} "):
        _first_pack(output, rows, encoder)[0]


def test_an_sft_pack_is_refused(dataset, hf_paths, monkeypatch):
    from qvl.data import preference_encode

    output, _, rows, _ = dataset
    encoder = _encoder(hf_paths)
    original = preference_encode.PreferenceTaskEncoder.encode_sample

    def without_pairs(self, sample):
        sample.meta.pop("pairs")  # as a pack of an SFT dataset is written
        return original(self, sample)

    monkeypatch.setattr(preference_encode.PreferenceTaskEncoder, "encode_sample", without_pairs)
    with pytest.raises(DataError, match=f"pack {rows[0]['pack']} holds SFT conversations.*--kind preference"):
        _first_pack(output, rows, encoder)[0]


def test_energons_savable_loader_restores_the_same_preference_batches(dataset, hf_paths):
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from qvl.data.write import CRUDE_CONFIG

    output, _, _, reference = dataset
    encoder = _encoder(hf_paths, reference)

    def loader():
        worker = WorkerConfig(rank=0, world_size=1, num_workers=0)
        dataset = get_train_dataset(
            output,
            batch_size=2,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            worker_config=worker,
            task_encoder=encoder,
            dataset_config=CRUDE_CONFIG,
        )
        return get_savable_loader(dataset, worker_config=worker, gc_collect_every_n_steps=0)

    def summary(batch) -> tuple:
        return batch.packs, batch.pairs.tolist(), batch.reference_logps.tolist(), batch.tokens.tolist()

    first = loader()
    stream = iter(first)
    next(stream)
    state = first.save_state_rank()
    expected = [summary(next(stream)) for _ in range(3)]
    restored = loader()
    restored.restore_state_rank(state)
    stream = iter(restored)
    assert [summary(next(stream)) for _ in range(3)] == expected


def _distinct_blocks(pixels: torch.Tensor, grid: torch.Tensor) -> list[int]:
    """Each image's distinct index by its pixel rows' values (the oracle: equal rows, the same image)."""
    blocks = pixels.split(grid.prod(-1).tolist())
    firsts: list[torch.Tensor] = []
    indices = []
    for block in blocks:
        match = next((i for i, first in enumerate(firsts) if torch.equal(first, block)), None)
        if match is None:
            firsts.append(block)
            match = len(firsts) - 1
        indices.append(match)
    return indices


def test_a_pairs_shared_image_is_decoded_once_marked_once_and_its_tower_inputs_are_the_distinct_grids(
    dataset, hf_paths, tokenizers, monkeypatch
):
    """A micro-batch of one pack twice (its images repeat across packs: the same bytes) and one more: the pixels are
    those of the encoder without de-duplication bitwise, one entry per placeholder; a pair's shared image is decoded
    once; `image_sources` numbers each distinct image (the oracle: its pixel rows), a pair's sides the same; the tower
    inputs are the distinct grid's, and the step's distinct pixels expand back to the batch's."""
    from qvl.data import encode
    from qvl.data.planned import PackMicroBatches
    from qvl.kernels.tower_inputs import first_occurrences, tower_inputs_for_config
    from qvl.training.step import distinct_pixels

    output, _, rows, _ = dataset
    packs = [(rows[0]["pack"], rows[0]["shard"])] * 2 + [(rows[1]["pack"], rows[1]["shard"])]
    encoders = [_encoder(hf_paths), _encoder(hf_paths)]
    encoders[1].deduplicate_vision = False  # the SFT encoder's default
    for encoder in encoders:
        encoder.tower_config = TINY_CONFIG["vision_config"]
    opened = []
    open_image = encode.Image.open
    monkeypatch.setattr(encode.Image, "open", lambda f: opened.append(f) or open_image(f))
    deduplicated = PackMicroBatches(output, encoders[0], packs, 3)[0]
    plain = PackMicroBatches(output, encoders[1], packs, 3)[0]

    assert torch.equal(deduplicated.pixel_values, plain.pixel_values)
    assert torch.equal(deduplicated.image_grid_thw, plain.image_grid_thw)
    assert plain.image_sources is None and deduplicated.video_sources is None
    grid = plain.image_grid_thw
    assert len(opened) == len(grid)  # both encoders: each pair's images once, where the placeholders name them twice
    sources = deduplicated.image_sources
    assert sources.dtype == torch.int64 and sources.tolist() == _distinct_blocks(plain.pixel_values, grid)
    image_pad = tokenizers[FAMILY].convert_tokens_to_ids("<|image_pad|>")
    positions = (deduplicated.tokens[0] == image_pad).nonzero().flatten()
    starts = (grid.prod(-1) // 4).cumsum(0) - grid.prod(-1) // 4  # each image's first placeholder (merge 2)
    subs = torch.searchsorted(deduplicated.cu_seqlens_q.long(), positions[starts], right=True) - 1
    for chosen, rejected in deduplicated.pairs.tolist():
        assert sources[subs == chosen].numel() and torch.equal(sources[subs == chosen], sources[subs == rejected])
    distinct_grid = grid[first_occurrences(sources)]
    assert 2 * int(distinct_grid.prod(-1).sum()) < int(grid.prod(-1).sum())
    expected = tower_inputs_for_config(distinct_grid, TINY_CONFIG["vision_config"])
    for name in ("position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"):
        assert torch.equal(getattr(deduplicated.image_tower_inputs, name), getattr(expected, name)), name
    assert plain.image_tower_inputs.cu_seqlens.numel() == len(grid) + 1
    given, vision_sources = distinct_pixels(deduplicated)
    assert given["pixel_values"].shape[0] == int(distinct_grid.prod(-1).sum())
    assert torch.equal(vision_sources.expanded(given["pixel_values"], None)[0], plain.pixel_values)
