"""The debug flavour's tokenizer and processor: offline tiny Qwen-VL processor directories for every family.

The tokenizer is a byte-level BPE trained in memory on a small corpus, so it needs no hub access, yet it has
Qwen's special tokens and a Qwen-style chat template; the processor config is the family's real one with the
pixel budget shrunk so test images stay small.
"""

from __future__ import annotations

import json
import pathlib

from qvl.foundation.families import SPECIAL_TOKENS, get_family

# Qwen2-VL / Qwen2.5-VL chat template (as shipped, minus tool calls): a default system prompt when none is given.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL chat template (as shipped, minus tools and reasoning): no default system prompt.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3.5-VL's reasoning rules on top of Qwen3-VL's template (the released template's `<think>` handling, minus tools):
# assistant turns after the last user turn carry their `reasoning_content` in a <think> block (empty without one),
# earlier ones their answer alone; `enable_thinking=false` opens the generation prompt with an empty block.
_THINK = (
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_query %}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{%- if not thinking %}{%- set reasoning = '' %}{%- endif %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
)
_LAST_QUERY = (
    "{%- set ns = namespace(last_query=-1) %}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
)
QWEN3_5_CHAT_TEMPLATE = (
    _LAST_QUERY + "{%- set thinking = enable_thinking is not defined or enable_thinking %}"
    + QWEN3_VL_CHAT_TEMPLATE.replace("{{- '<|im_start|>' + message['role'] + '\\n' }}",
                                     "{{- '<|im_start|>' + message['role'] + '\\n' }}" + _THINK)
    .replace("{{- '<|im_start|>assistant\\n' }}",
             "{{- '<|im_start|>assistant\\n' }}{%- if not thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
)  # fmt: skip
# Qwen3.8's switch, `reasoning_effort` (none, low, medium, xhigh; none turns thinking off), in the same rules. A
# stand-in that exercises the switch: the effort is a system line here, not necessarily Qwen3.8's own wording.
QWEN3_8_CHAT_TEMPLATE = (
    "{%- if reasoning_effort is defined and reasoning_effort not in ['none', 'low', 'medium', 'xhigh'] %}"
    "{{- raise_exception('reasoning_effort must be none, low, medium or xhigh') }}{%- endif %}"
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'xhigh' %}"
    "{{- '<|im_start|>system\\nReasoning effort: ' + effort + '<|im_end|>\\n' }}"
    + QWEN3_5_CHAT_TEMPLATE.replace(
        "{%- set thinking = enable_thinking is not defined or enable_thinking %}",
        "{%- set thinking = effort != 'none' %}",
    )
)  # fmt: skip
CHAT_TEMPLATES = {
    "qwen2": QWEN2_VL_CHAT_TEMPLATE,
    "qwen3": QWEN3_VL_CHAT_TEMPLATE,
    "qwen3_5": QWEN3_5_CHAT_TEMPLATE,
    "qwen3_8": QWEN3_8_CHAT_TEMPLATE,
}
THINK_TOKENS = ("<think>", "</think>")  # Qwen3's reasoning delimiters, single added tokens in its vocabulary

_CORPUS = (
    "You are a helpful assistant. What is shown in the picture? Describe the image in detail.",
    "The image shows a red square, a blue circle and a green triangle on a white background.",
    "How many objects are there? There are 3 objects. Which one is the largest? The red one.",
    "Picture Video seconds user assistant system: question answer the cat sat on the mat, quickly!",
    "0 1 2 3 4 5 6 7 8 9 10 100 2024 3.5 0.5 <12.5 seconds> (a) [b] {c} \"quote\" 'single' - _ / \\ ? ! ; :",
    "Ünïcödé text, 中文 字符, emoji 🙂 and tabs\tand\nnew lines are all handled byte by byte.",
)


def build_tiny_tokenizer(family: str, vocab_size: int = 1024, release: str | None = None):
    """A PreTrainedTokenizerFast with Qwen's special tokens and the family's (or its `release`'s) chat template,
    built offline; a reasoning template's <think> delimiters are single tokens, as in Qwen's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size > 2048 or vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is outside the tiny range; use 300..2048")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    record = get_family(family)
    chosen = record.release(release)
    template = CHAT_TEMPLATES[(chosen.chat_template if chosen else None) or record.chat_template]
    added = list(THINK_TOKENS) if "<think>" in template else []  # ids after the trained ones, below `vocab_size`
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=template,
        model_max_length=1 << 20,
    )
    fast.add_tokens(added)
    return fast


def preprocessor_config(family: str) -> dict:
    """The family's `preprocessor_config.json` content with a tiny pixel budget."""
    record = get_family(family)
    min_pixels, max_pixels = record.tiny_pixels
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": record.processor_class,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": list(record.image_mean),
        "image_std": list(record.image_std),
        "patch_size": record.patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }


def video_preprocessor_config(family: str) -> dict:
    """The family's `video_preprocessor_config.json` content with a tiny pixel budget."""
    config = preprocessor_config(family)
    config.pop("image_processor_type")
    config["video_processor_type"] = get_family(family).video_processor_class
    config["size"] = {
        "shortest_edge": config["size"]["shortest_edge"],
        "longest_edge": 4 * config["size"]["longest_edge"],
    }
    config["fps"] = 2.0
    return config


def write_tiny_hf_processor_dir(
    path: pathlib.Path, family: str, vocab_size: int = 1024, release: str | None = None
) -> pathlib.Path:
    """Write a tiny tokenizer + processor configs for `family` (its `release`'s template) into `path` (loadable
    with HF_HUB_OFFLINE=1)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(family, vocab_size, release)
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(family), indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_preprocessor_config(family), indent=2))
    return path
