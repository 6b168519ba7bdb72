"""`qvl data prepare` on preference pairs: every broken pair quarantined with its reason and no good pair lost, both
sides of a pair adjacent in one pack (chosen first) with the pair's media stored once, a DP plan costing a pair as two
sequences and its images once; and an SFT dataset never trains a record that has a rejected side."""

from __future__ import annotations

import io
import json
import re
import tarfile

import numpy as np
import pytest

from qvl.data.ingest import IngestConfig
from qvl.data.preference import to_pair
from qvl.data.preference_samples import FORMATS, bad_pair_reasons, write_preference_samples
from qvl.data.prepare import PrepareConfig, prepare
from qvl.foundation.cost import lm_flops_per_sequence, shapes_from_hf_config, vision_flops_per_image
from qvl.foundation.errors import DataError
from qvl.launchers.cli import main

from .conftest import save_image, write_jsonl
from .test_balance import TINY_CONFIG

GOOD = 12
SEQ_LENGTH = 512
FAMILY = "qwen2_5_vl"


def _config(hf_paths, jsonl, media, output, **changes) -> PrepareConfig:
    settings = dict(input=jsonl, media_root=media, family=FAMILY, hf_path=hf_paths[FAMILY], seq_length=SEQ_LENGTH)
    return PrepareConfig(**settings, output=output, **changes)


@pytest.fixture(scope="module")
def prepared(hf_paths, tmp_path_factory) -> dict:
    """Each format's sample pairs prepared (TRL's with a DP plan and small chunks), as {format: (output, records)}."""
    root = tmp_path_factory.mktemp("pairs")
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = {}
    for fmt in FORMATS:
        jsonl, media = write_preference_samples(root / fmt, format=fmt, count=GOOD)
        plan = dict(data_parallel=2, global_batch_size=2, model_config=root / "config.json", chunk_size=5)
        prepare(_config(hf_paths, jsonl, media, root / f"out-{fmt}", **(plan if fmt == "trl" else {})))
        out[fmt] = root / f"out-{fmt}", [json.loads(line) for line in jsonl.read_text().splitlines()]
    return out


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _packs(output) -> list[tuple[dict, dict]]:
    """(pack json, {member: bytes}) of every pack, in shard order."""
    packs = []
    for shard in sorted(output.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name in sorted(n for n in members if n.endswith(".json")):
            key = name[: -len(".json")]
            packs.append(
                (
                    json.loads(members[name]),
                    {n[len(key) + 1 :]: b for n, b in members.items() if n.startswith(key + ".")},
                )
            )
    return packs


@pytest.mark.parametrize("fmt", FORMATS)
def test_broken_pairs_are_quarantined_with_their_reasons_and_no_good_pair_is_lost(prepared, fmt):
    output, records = prepared[fmt]
    reasons = bad_pair_reasons(fmt)
    quarantine = _jsonl(output / "quarantine.jsonl")
    assert {q["index"]: q["reason"] for q in quarantine} == {GOOD + k: r for k, r in enumerate(reasons)}
    assert all(q["detail"] for q in quarantine)
    report = json.loads((output / "report.json").read_text())
    assert (report["kind"], report["pairs"], report["accepted"]) == ("preference", GOOD, GOOD)
    assert report["read"] == len(records) == report["accepted"] + report["quarantined"]
    placed = [i for p in _jsonl(output / "packs.jsonl") for i in p["samples"]]
    assert sorted(placed) == sorted(2 * list(range(GOOD)))  # every good pair, both sides, once
    assert report["total_tokens"] == sum(sum(p["lengths"]) for p in _jsonl(output / "packs.jsonl"))
    (too_long,) = [q["detail"] for q in quarantine if q["reason"] == "pair_too_long"]
    assert re.fullmatch(r"chosen (\d+) \+ rejected (\d+) = \d+ tokens > seq_length 512 \(.*\)", too_long)


def test_both_sides_of_a_pair_are_adjacent_in_one_pack_chosen_first(prepared, tokenizers):
    output, records = prepared["trl"]
    rows = {row["pack"]: row for row in _jsonl(output / "packs.jsonl")}
    seen = []
    for meta, members in _packs(output):
        subs = meta["subs"]
        assert meta["pairs"] == [[k, k + 1] for k in range(0, len(subs), 2)]
        assert rows[meta["pack"]]["samples"] == meta["samples"] and rows[meta["pack"]]["pairs"] == len(subs) // 2
        assert sum(meta["lengths"]) <= SEQ_LENGTH and rows[meta["pack"]]["lengths"] == meta["lengths"]
        chosen_rows = sum(int(np.prod(g)) for k, sub in enumerate(subs) if k % 2 == 0 for g in sub["image_grid_thw"])
        assert rows[meta["pack"]]["vision_rows"] == [chosen_rows, 0]  # a pair's shared images: the tower's once
        ids = np.load(io.BytesIO(members["ids.npy"]))
        loss = np.load(io.BytesIO(members["loss.npy"])).astype(bool)
        bounds = np.r_[0, np.cumsum(meta["lengths"])]
        for chosen, rejected in meta["pairs"]:
            index = subs[chosen]["index"]
            assert subs[rejected]["index"] == index
            pair = to_pair(index, records[index], IngestConfig())
            for sub, side in ((chosen, pair.chosen), (rejected, pair.rejected)):
                part = slice(bounds[sub], bounds[sub + 1])
                answer = side.messages[-1]["content"][0]["text"]
                assert tokenizers[FAMILY].decode(ids[part][loss[part]].tolist()) == f"{answer}<|im_end|>"
            seen.append(index)
    assert sorted(seen) == list(range(GOOD))
    assert any(row["vision_rows"][0] for row in rows.values())


@pytest.mark.parametrize("fmt", ["trl", "ms-swift"])
def test_a_pairs_media_are_stored_once_and_named_by_both_sides(prepared, fmt):
    output, _ = prepared[fmt]
    images = 0
    for meta, members in _packs(output):
        stored = sorted(name for name in members if name.startswith("img"))
        chosen_media = [m["member"] for c, _ in meta["pairs"] for m in meta["subs"][c]["media"]]
        assert sorted(chosen_media) == stored  # one file per image of a pair, none for its rejected side
        for chosen, rejected in meta["pairs"]:
            assert meta["subs"][rejected]["media"] == meta["subs"][chosen]["media"]
            assert meta["subs"][rejected]["image_grid_thw"] == meta["subs"][chosen]["image_grid_thw"]
        images += len(stored)
    assert json.loads((output / "report.json").read_text())["media"] == images  # a pair's images counted once


def test_the_dp_plan_costs_a_pair_as_two_sequences_and_its_images_once(prepared):
    output, _ = prepared["trl"]
    lm, vision = shapes_from_hf_config(output.parent / "config.json")
    rows = {row["pack"]: row for row in _jsonl(output / "packs.jsonl")}
    assert json.loads((output / "report.json").read_text())["dp_plan"]["data_parallel"] == 2
    for meta, _ in _packs(output):
        grids = np.asarray([g for c, _ in meta["pairs"] for g in meta["subs"][c]["image_grid_thw"]]).reshape(-1, 3)
        expected = lm_flops_per_sequence(lm, np.asarray(meta["lengths"])).sum()
        expected += vision_flops_per_image(vision, grids).sum() if len(grids) else 0.0
        assert rows[meta["pack"]]["cost"] == pytest.approx(expected, rel=1e-9)


def test_an_sft_dataset_quarantines_every_record_with_a_rejected_side(prepared, hf_paths, tmp_path):
    """Before pairs were read, an ms-swift pair (`messages` + `rejected_response`) was accepted as SFT with its
    rejected answer dropped; now it is quarantined whether --kind is sft or decided by a first SFT record."""
    _, records = prepared["ms-swift"]
    sft_record = records[GOOD + bad_pair_reasons("ms-swift").index("not_a_pair")]
    media = prepared["ms-swift"][0].parent / "ms-swift" / "images"
    jsonl = write_jsonl(tmp_path / "mixed.jsonl", [sft_record, *records[:GOOD]])
    for kind in ("auto", "sft"):
        report = prepare(_config(hf_paths, jsonl, media, tmp_path / kind, kind=kind))
        assert (report["kind"], report["accepted"]) == ("sft", 1)
        assert report["quarantined_by_reason"] == {"preference_record": GOOD}
        details = {q["detail"] for q in _jsonl(tmp_path / kind / "quarantine.jsonl")}
        assert details == {"record has 'rejected_response': a preference pair; prepare it with --kind preference"}


def test_truncate_is_refused_for_pairs(prepared, hf_paths, tmp_path):
    output, _ = prepared["llama-factory"]
    jsonl = output.parent / "llama-factory" / "pairs-llama-factory.jsonl"
    with pytest.raises(DataError, match="--truncate does not apply to preference pairs.*pair_too_long"):
        prepare(_config(hf_paths, jsonl, jsonl.parent / "images", tmp_path / "t", truncate=True))


def test_the_command_line_takes_kind_and_stats_shows_pairs(prepared, hf_paths, tmp_path, capsys):
    output, _ = prepared["rlaif-v"]
    jsonl, media = output.parent / "rlaif-v" / "pairs-rlaif-v.jsonl", output.parent / "rlaif-v" / "images"
    argv = ["data", "prepare", "--input", str(jsonl), "--media-root", str(media), "--family", FAMILY]
    argv += ["--hf-path", str(hf_paths[FAMILY]), "--seq-length", "512", "--workers", "1", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "sft"), "--kind", "sft"]) == 0  # its one SFT record
    assert json.loads((tmp_path / "sft" / "report.json").read_text())["accepted"] == 1
    capsys.readouterr()
    assert main([*argv, "--output", str(tmp_path / "pref"), "--kind", "preference"]) == 0
    assert main(["data", "stats", str(tmp_path / "pref")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.search(r"^kind +preference$", "\n".join(lines), re.M)
    assert re.search(rf"^accepted +{GOOD} pairs$", "\n".join(lines), re.M)


def test_a_pair_with_a_video_and_an_image_stores_its_frames_once(hf_paths, tmp_path):
    for f in range(4):
        save_image(tmp_path / "clip" / f"{f:03d}.jpg", 96, 64, seed=f, fmt="JPEG")
    save_image(tmp_path / "a.png", 60, 40)
    question = [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What moves?"}]
    record = {"prompt": [{"role": "user", "content": question}], "chosen": "The ball.", "rejected": "The box."}
    jsonl = write_jsonl(tmp_path / "video.jsonl", [{**record, "videos": ["clip"], "images": ["a.png"], "fps": 2.0}])
    report = prepare(_config(hf_paths, jsonl, tmp_path, tmp_path / "out", kind="preference"))
    assert (report["pairs"], report["media"]) == (1, 2)
    ((meta, members),) = _packs(tmp_path / "out")
    chosen, rejected = meta["subs"]
    assert meta["pairs"] == [[0, 1]] and rejected["media"] == chosen["media"]
    assert [m["kind"] for m in chosen["media"]] == ["frames", "image"]
    assert rejected["video_grid_thw"] == chosen["video_grid_thw"] != []
    assert len([n for n in members if n.startswith(("img", "vid"))]) == 4 + 1  # four frames and the image, once
