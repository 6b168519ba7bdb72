"""Ingest reads ShareGPT and OpenAI formats, JSON and JSONL, into one canonical conversation."""

from __future__ import annotations

import json

import pytest

from qvl.data.ingest import IngestConfig, Rejection, read_records, to_conversation
from qvl.data.prepare import PrepareConfig, prepare


def test_json_array_and_openai_messages_with_listed_and_inline_media(tmp_path):
    records = [
        {
            "messages": [
                {"role": "system", "content": "S."},
                {"role": "user", "content": "<image>A <image>B"},
                {"role": "assistant", "content": [{"type": "text", "text": "C"}]},
            ],
            "images": ["a.png", {"path": "b.png"}],
        },
        {
            "conversations": [
                {"from": "human", "value": [{"type": "image", "image": "c.png"}, "Q"]},
                {"from": "gpt", "value": "R"},
            ]
        },
        "not an object",
    ]
    (tmp_path / "in.json").write_text(json.dumps(records))
    read = list(read_records(tmp_path / "in.json"))
    assert [i for i, _ in read] == [0, 1, 2] and isinstance(read[2][1], Rejection)
    first = to_conversation(0, read[0][1], IngestConfig(system_prompt="unused"))
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant"]
    assert first.messages[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "A "},
        {"type": "image"},
        {"type": "text", "text": "B"},
    ]
    assert [m.path for m in first.media] == ["a.png", "b.png"]
    second = to_conversation(1, read[1][1], IngestConfig(system_prompt="Be kind."))
    assert second.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be kind."}]}
    assert [m.path for m in second.media] == ["c.png"] and second.placeholder_counts == {"image": 0, "video": 0}


def test_jsonl_indices_skip_blank_lines_and_keep_bad_lines(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"conversations": []}\n\n{broken\n{"messages": []}\n')
    read = list(read_records(tmp_path / "in.jsonl"))
    assert [i for i, _ in read] == [0, 1, 2]
    assert isinstance(read[1][1], Rejection) and read[1][1].reason == "bad_json"


def test_prepare_refuses_to_replace_a_foreign_output_directory(tmp_path, hf_paths):
    (tmp_path / "in.jsonl").write_text("")
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    config = PrepareConfig(
        input=tmp_path / "in.jsonl",
        media_root=tmp_path,
        family="qwen2_vl",
        hf_path=hf_paths["qwen2_vl"],
        seq_length=128,
        output=foreign,
    )
    with pytest.raises(ValueError, match="not a qvl dataset"):
        prepare(config)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_all_rejected_input_fails_with_the_quarantine_written(tmp_path, hf_paths):
    (tmp_path / "in.jsonl").write_text('{"conversations": [{"from": "human", "value": "<image>"}]}\n')
    config = PrepareConfig(
        input=tmp_path / "in.jsonl",
        media_root=tmp_path,
        family="qwen2_vl",
        hf_path=hf_paths["qwen2_vl"],
        seq_length=128,
        output=tmp_path / "out",
    )
    with pytest.raises(ValueError, match="quarantine.jsonl"):
        prepare(config)
    assert json.loads((tmp_path / "out" / "quarantine.jsonl").read_text())["reason"] == "no_assistant_turn"
    assert not (tmp_path / "out" / ".nv-meta").exists()
