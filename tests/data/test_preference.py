"""Preference records: every format reads to the same canonical pair, each side's tokens are exactly the processor's
with only its completion learned, and what only pairs can get wrong is caught before any packing."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from qvl.data.count import TokenCounter
from qvl.data.ingest import IngestConfig, Rejection, to_conversation
from qvl.data.preference import to_pair, validate_pair
from qvl.data.preference_samples import FORMATS, write_preference_samples
from qvl.data.validate import ValidateConfig, validate_sample
from qvl.data.vision import load_vision_config

from .conftest import FAMILIES, reference_processor, save_image

INGEST = IngestConfig()


def _canonical(pair) -> tuple:
    return tuple((s.messages, [(m.kind, m.path) for m in s.media], s.learn_last) for s in (pair.chosen, pair.rejected))


@pytest.fixture(scope="module")
def sample_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("formats")
    return {f: write_preference_samples(root / f, format=f, count=14, with_bad=False)[0] for f in FORMATS}


def _pairs(path) -> list:
    return [to_pair(i, json.loads(line), INGEST) for i, line in enumerate(path.read_text().splitlines())]


def test_every_format_reads_to_the_same_canonical_pair(sample_files):
    trl = _pairs(sample_files["trl"])
    assert all(not isinstance(p, Rejection) for p in trl)
    multi_turn = [i for i, p in enumerate(trl) if sum(m["role"] == "assistant" for m in p.chosen.messages) == 2]
    two_images = [i for i, p in enumerate(trl) if len(p.chosen.media) == 2]
    assert multi_turn and two_images  # the sample covers both
    for fmt in ("ms-swift", "llama-factory"):
        assert [_canonical(p) for p in _pairs(sample_files[fmt])] == [_canonical(p) for p in trl], fmt
    # RLAIF-V's records are one question (its images put before the text): equal wherever the prompt is one turn.
    rlaif = _pairs(sample_files["rlaif-v"])
    single = [i for i in range(len(trl)) if i not in multi_turn]
    assert [_canonical(rlaif[i]) for i in single] == [_canonical(trl[i]) for i in single]
    assert all(p.chosen.learn_last == p.rejected.learn_last == 1 for p in trl)


def test_each_format_variant_reads_to_the_same_pair():
    image = {"type": "image"}
    turns = [
        {"role": "user", "content": [image, {"type": "text", "text": "\nWhat is it?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    explicit = {"prompt": turns[:1], "chosen": turns[1:], "rejected": [{"role": "assistant", "content": "A dog."}]}
    variants = {
        "trl": {**explicit, "images": ["a.png"]},
        "trl, implicit prompt": {
            "chosen": turns,
            "rejected": [turns[0], {"role": "assistant", "content": "A dog."}],
            "images": ["a.png"],
        },
        "trl, strings": {
            "prompt": "<image>\nWhat is it?",
            "chosen": "A cat.",
            "rejected": "A dog.",
            "images": ["a.png"],
        },
        "rlaif-v": {"question": "What is it?", "chosen": "A cat.", "rejected": "A dog.", "image": {"path": "a.png"}},
        "rlaif-v, placeholder": {
            "question": "<image>\nWhat is it?",
            "chosen": "A cat.",
            "rejected": "A dog.",
            "image": "a.png",
        },
        "ms-swift": {
            "messages": [
                {"role": "user", "content": "<image>\nWhat is it?"},
                {"role": "assistant", "content": "A cat."},
            ],
            "rejected_response": "A dog.",
            "images": ["a.png"],
        },
        "ms-swift, rejected_messages": {
            "messages": [
                {"role": "user", "content": "<image>\nWhat is it?"},
                {"role": "assistant", "content": "A cat."},
            ],
            "rejected_messages": [
                {"role": "user", "content": "<image>\nWhat is it?"},
                {"role": "assistant", "content": "A dog."},
            ],
            "rejected_images": ["a.png"],
            "images": ["a.png"],
        },
        "llama-factory": {
            "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}],
            "chosen": {"from": "gpt", "value": "A cat."},
            "rejected": {"from": "gpt", "value": "A dog."},
            "images": ["a.png"],
        },
    }
    pairs = {name: to_pair(0, record, INGEST) for name, record in variants.items()}
    expected = _canonical(pairs["trl"])
    assert expected[0][0][-1]["content"] == [{"type": "text", "text": "A cat."}]
    assert {name: _canonical(p) for name, p in pairs.items()} == {name: expected for name in variants}


def test_system_prompts_reasoning_and_videos_are_kept_on_both_sides():
    record = {
        "conversations": [{"from": "human", "value": "<video>\nWhat moves?"}],
        "system": "Be brief.",
        "chosen": {"from": "gpt", "value": "A ball.", "reasoning_content": "It rolls."},
        "rejected": {"from": "gpt", "value": "Nothing.", "reasoning": "I see no motion."},
        "videos": ["clip"],
        "fps": 2.0,
    }
    pair = to_pair(3, record, INGEST)
    assert [m["role"] for m in pair.chosen.messages] == ["system", "user", "assistant"]
    assert pair.chosen.messages[-1]["reasoning_content"] == "It rolls."
    assert pair.rejected.messages[-1]["reasoning_content"] == "I see no motion."
    assert [(m.kind, m.path, m.fps) for m in pair.rejected.media] == [("video", "clip", 2.0)]
    assert pair.chosen.messages[:-1] == pair.rejected.messages[:-1]


@pytest.mark.parametrize(
    ("record", "reason", "detail"),
    [
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
            "not_a_pair",
            "--kind sft",
        ),
        ({"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}, "pair_identical", "Hello."),
        ({"prompt": "Hi?", "chosen": "Hello."}, "pair_missing_side", "rejected"),
        ({"prompt": "Hi?", "chosen": [], "rejected": "Go away."}, "pair_missing_side", "chosen"),
        ({"question": "Hi?", "chosen": "Hello.", "rejected": "  "}, "pair_missing_side", "rejected"),
        (
            {"messages": [{"role": "user", "content": "Hi?"}], "rejected_response": "Go away."},
            "pair_missing_side",
            "chosen",
        ),
        (
            {
                "messages": [{"role": "user", "content": "<image>Hi?"}, {"role": "assistant", "content": "Hello."}],
                "rejected_response": "Go away.",
                "images": ["a.png"],
                "rejected_images": ["b.png"],
            },
            "pair_media_differ",
            "image:a.png'] != rejected side's ['image:b.png",
        ),
        (
            {
                "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
                "rejected_messages": [{"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Go."}],
            },
            "pair_prompt_differ",
            "different prompts",
        ),
        ({"prompt": "Hi?", "chosen": 3, "rejected": "Go."}, "bad_format", "'chosen' of type int"),
        ({"prompt": [{"role": "user"}], "chosen": [{"content": "x"}], "rejected": "Go."}, "bad_format", "chosen side"),
    ],
    ids=[
        "sft-record",
        "identical",
        "no-rejected",
        "empty-chosen",
        "blank-rejected",
        "swift-no-answer",
        "swift-rejected-images",
        "swift-rejected-prompt",
        "chosen-not-text",
        "turn-without-role",
    ],
)
def test_what_only_pairs_get_wrong_is_one_reason_with_a_detail(record, reason, detail):
    rejection = to_pair(7, record, INGEST)
    assert isinstance(rejection, Rejection) and (rejection.index, rejection.reason) == (7, reason)
    assert detail in rejection.detail


def test_each_side_meets_the_sft_checks_named_by_side(tmp_path, hf_paths):
    vision = load_vision_config(hf_paths["qwen2_vl"], "qwen2_vl")
    config = ValidateConfig(media_root=tmp_path, vision=vision)
    missing = to_pair(0, {"prompt": "<image>Hi?", "chosen": "A.", "rejected": "B.", "images": ["gone.png"]}, INGEST)
    assert (validate_pair(missing, config).reason, validate_pair(missing, config).detail[:12]) == (
        "image_missing",
        "chosen side:",
    )
    special = to_pair(0, {"prompt": "Hi?", "chosen": "A.", "rejected": "B <|im_start|>"}, INGEST)
    rejection = validate_pair(special, config)
    assert rejection.reason == "special_token_in_text" and rejection.detail.startswith("rejected side:")
    ends_with_user = {
        "prompt": "Hi?",
        "chosen": [{"role": "assistant", "content": "A."}, {"role": "user", "content": "?"}],
        "rejected": "B.",
    }
    assert validate_pair(to_pair(0, ends_with_user, INGEST), config).reason == "bad_roles"


def _learned_text(tokenizer, ids, loss) -> str:
    return tokenizer.decode(ids[loss.astype(bool)].tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_side_counts_exactly_as_the_processor_with_only_its_completion_learned(
    family, hf_paths, tokenizers, tmp_path, monkeypatch
):
    tokenizer = tokenizers[family]
    vision = load_vision_config(hf_paths[family], family)
    counter = TokenCounter(tokenizer=tokenizer, vision=vision)
    processor = reference_processor(family, hf_paths[family], tokenizer, monkeypatch)
    for k, (w, h) in enumerate([(90, 60), (33, 300)]):
        save_image(tmp_path / f"{k}.png", w, h, seed=k)
    record = {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Is there a shape?"}]},
            {"role": "assistant", "content": "Yes, one shape."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is the second?"}]},
        ],
        "chosen": [{"role": "assistant", "content": "It is red."}],
        "rejected": [{"role": "assistant", "content": "It is a very blue one."}],
        "images": ["0.png", "1.png"],
    }
    chosen, rejected = validate_pair(to_pair(0, record, INGEST), ValidateConfig(media_root=tmp_path, vision=vision))
    images = [Image.open(tmp_path / f"{k}.png").convert("RGB") for k in range(2)]
    sides = counter.count([chosen, rejected])
    for side, counted, answer in zip((chosen, rejected), sides, ("It is red.", "It is a very blue one."), strict=True):
        text = tokenizer.apply_chat_template(side.conversation.messages, tokenize=False)
        ids, loss = counted.expand(counter.pad_ids)
        assert ids.tolist() == list(processor(text=[text], images=images)["input_ids"][0])
        assert counted.length == len(ids)
        learned = _learned_text(tokenizer, ids, loss)
        assert learned.endswith(f"{answer}<|im_end|>") and "Yes, one shape." not in learned
        # The same conversation as SFT learns the earlier answer too: learn_last=None is SFT's counting unchanged.
        everything = validate_sample(
            to_conversation(0, {"messages": side.conversation.messages, "images": record["images"]}, INGEST),
            ValidateConfig(media_root=tmp_path, vision=vision),
        )
        sft_ids, sft_loss = counter.count([everything])[0].expand(counter.pad_ids)
        assert sft_ids.tolist() == ids.tolist() and (sft_loss >= loss).all()
        assert _learned_text(tokenizer, sft_ids, sft_loss & ~loss.astype(bool)).strip() == "Yes, one shape.<|im_end|>"
