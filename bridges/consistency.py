"""Is an HF Qwen-VL checkpoint consistent with itself? Checked before convert / verify build anything.

A tokenizer whose `<|image_pad|>` id differs from config.json's `image_token_id`, or an image processor for
another family (patch 14 vs 16), otherwise fails deep in the forward pass ("Image features and image tokens do
not match", "shape '[-1, 3, 2, 16, 16]' is invalid"). Each check names the file, the field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qvl.foundation.errors import ConversionError
from qvl.foundation.families import family_of_architecture

# config.json field -> the special token the tokenizer must map to the same id.
TOKEN_FIELDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# preprocessor_config.json field -> vision_config field with the same meaning.
PROCESSOR_FIELDS = {"patch_size": "patch_size", "merge_size": "spatial_merge_size", "temporal_patch_size": "temporal_patch_size"}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointFiles:
    """What an HF checkpoint directory carries besides config and weights."""

    tokenizer: bool
    processor: bool


def read_config(hf_path: Path) -> dict:
    """config.json as a dict, or an error naming the file."""
    path = Path(hf_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConversionError(
            f"{path} cannot be read as JSON ({err}); the checkpoint is incomplete or corrupt"
        ) from err


def config_token_id(config: dict, field: str) -> int | None:
    """A token id from the top level of config.json, or its text_config (where some exports keep it)."""
    value = config.get(field)
    return value if value is not None else (config.get("text_config") or {}).get(field)


def check_hf_checkpoint(hf_path: Path) -> CheckpointFiles:
    """Token ids, processor family and patch sizes agree with config.json; returns which side files exist."""
    hf_path = Path(hf_path)
    config = read_config(hf_path)
    files = CheckpointFiles(
        tokenizer=any((hf_path / name).is_file() for name in TOKENIZER_FILES),
        processor=(hf_path / PROCESSOR_FILE).is_file(),
    )
    if files.tokenizer:
        _check_token_ids(hf_path, config)
    if files.processor:
        _check_processor(hf_path, config)
    return files


def _check_token_ids(hf_path: Path, config: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_path))
    for field, token in TOKEN_FIELDS.items():
        expected = config_token_id(config, field)
        found = tokenizer.convert_tokens_to_ids(token)
        if expected is None or found is None or found == tokenizer.unk_token_id:
            continue
        if found != expected:
            raise ConversionError(
                f"{hf_path}: the tokenizer maps {token} to id {found} but config.json has {field}={expected}; the "
                f"tokenizer files belong to another model: copy the tokenizer the model was trained with, or set "
                f"{field}={found} in config.json if the tokenizer is right"
            )


def _check_processor(hf_path: Path, config: dict) -> None:
    path = hf_path / PROCESSOR_FILE
    try:
        processor = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err}); copy it again from the checkpoint") from err
    vision = config.get("vision_config") or {}
    for ours, theirs in PROCESSOR_FIELDS.items():
        if ours in processor and theirs in vision and processor[ours] != vision[theirs]:
            raise ConversionError(
                f"{path}: {ours}={processor[ours]} but config.json's vision_config.{theirs}={vision[theirs]}; the "
                "processor files belong to another model family: copy the processor of the checkpoint "
                f"(or delete {PROCESSOR_FILE} and `qvl convert verify` builds its inputs from config.json)"
            )
    family = family_of_architecture((config.get("architectures") or [""])[0])
    declared = processor.get("processor_class")
    if family is not None and declared and declared != family.processor_class:
        raise ConversionError(
            f"{path}: processor_class={declared}, but config.json is a {family.title} model whose processor is "
            f"{family.processor_class}; copy the processor files of the checkpoint"
        )
