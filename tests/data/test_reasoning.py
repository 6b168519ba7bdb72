"""Reasoning-trace data as Qwen3.5 / 3.6 / 3.8 users prepare it: assistant turns with thinking content rendered by
the checkpoint's own chat template, its switches (`enable_thinking`, Qwen3.8's `reasoning_effort`) settable, token
ids exactly the processor's, and loss masks that learn the reasoning block with its answer or read it only."""

from __future__ import annotations

import pytest
from PIL import Image

from qvl.data.count import TokenCounter, load_tokenizer
from qvl.data.ingest import IngestConfig, to_conversation
from qvl.data.validate import ValidateConfig, validate_sample
from qvl.data.vision import load_vision_config
from qvl.foundation.errors import DataError
from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

from .conftest import reference_processor, save_image

FAMILY = "qwen3_5_vl"
RECORD = {
    "messages": [
        {"role": "user", "content": "<image>\nWhat shape is it?"},
        {"role": "assistant", "content": "A square.", "reasoning": "Four equal sides.\nRight angles."},
        {"role": "user", "content": "And its colour?"},
        {"role": "assistant", "content": "Red.", "reasoning_content": "The fill is red."},
    ],
    "image": "img.png",
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """Tiny Qwen3.5 and Qwen3.8 tokenizer + processor dirs (their templates differ: enable_thinking, reasoning_effort)."""
    root = tmp_path_factory.mktemp("reasoning")
    return {
        release: write_tiny_hf_processor_dir(root / str(release), FAMILY, release=release) for release in (None, "3.8")
    }


def _sample(tmp_path, vision):
    save_image(tmp_path / "img.png", 90, 60)
    conversation = to_conversation(0, RECORD, IngestConfig())
    return validate_sample(conversation, ValidateConfig(media_root=tmp_path, vision=vision))


def test_ingest_keeps_the_reasoning_under_the_name_the_templates_read():
    messages = to_conversation(0, RECORD, IngestConfig()).messages
    assert [m.get("reasoning_content") for m in messages] == [
        None,
        "Four equal sides.\nRight angles.",
        None,
        "The fill is red.",
    ]


@pytest.mark.parametrize(
    "release, switches",
    [
        (None, {}),
        (None, {"enable_thinking": False}),
        ("3.8", {"reasoning_effort": "low"}),
        ("3.8", {"reasoning_effort": "none"}),
    ],
)
def test_token_ids_are_the_processors_under_each_switch(release, switches, releases, tmp_path, monkeypatch):
    tokenizer = load_tokenizer(releases[release])
    vision = load_vision_config(releases[release], FAMILY)
    counter = TokenCounter(tokenizer=tokenizer, vision=vision, template_args=tuple(switches.items()))
    sample = _sample(tmp_path, vision)
    ids, _ = counter.count([sample])[0].expand(counter.pad_ids)
    processor = reference_processor(FAMILY, releases[release], tokenizer, monkeypatch)
    text = processor.apply_chat_template(sample.conversation.messages, tokenize=False, **switches)
    reference = processor(text=[text], images=[Image.open(tmp_path / "img.png").convert("RGB")])
    assert ids.tolist() == list(reference["input_ids"][0])
    thinking = switches.get("enable_thinking", True) and switches.get("reasoning_effort") != "none"
    assert ("The fill is red." in text) == thinking  # the switch reached the template
    assert "Four equal sides." not in text  # reasoning before the last question is dropped, as the template does


@pytest.mark.parametrize("reasoning_loss, learned", [
    (True, "A square.<|im_end|><think>\nThe fill is red.\n</think>\n\nRed.<|im_end|>"),
    (False, "A square.<|im_end|>Red.<|im_end|>"),
])  # fmt: skip
def test_the_reasoning_block_is_learned_or_only_read(reasoning_loss, learned, releases, tmp_path):
    tokenizer = load_tokenizer(releases[None])
    vision = load_vision_config(releases[None], FAMILY)
    counter = TokenCounter(tokenizer=tokenizer, vision=vision, reasoning_loss=reasoning_loss)
    ids, loss = counter.count([_sample(tmp_path, vision)])[0].expand(counter.pad_ids)
    assert tokenizer.decode(ids[loss.astype(bool)].tolist()) == learned


def test_a_switch_the_template_does_not_read_is_named(releases, tmp_path):
    from qvl.data.prepare import PrepareConfig, prepare

    (tmp_path / "in.jsonl").write_text("{}\n")
    config = PrepareConfig(
        input=tmp_path / "in.jsonl",
        media_root=tmp_path,
        family=FAMILY,
        hf_path=releases[None],  # Qwen3.5's template: enable_thinking, no reasoning_effort
        seq_length=256,
        output=tmp_path / "out",
        template_args={"reasoning_effort": "low"},
    )
    with pytest.raises(DataError, match=r"does not read 'reasoning_effort'; its switches: .*enable_thinking"):
        prepare(config)
