"""The debug flavour as a checkpoint: a tiny random HF model of any family, for tests, the demo and benchmarks.

The shapes are each family's `tiny_text` / `tiny_vision` (qvl.foundation.families): the real block structure
(Qwen2-VL's LayerNorm/non-gated vision MLP, Qwen2.5-VL's window attention and full-attention blocks, Qwen3-VL's
deepstack and learned vision position embedding, Qwen3-VL-MoE's experts) at widths of 32-64. Token ids come
from the tiny tokenizer of `qvl.foundation.tiny_processor`, whose special tokens are ids 0-6. No hub access.
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch

from qvl.foundation.families import TINY_TOKEN_IDS, TINY_VOCAB_SIZE, get_family
from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

VOCAB_SIZE = TINY_VOCAB_SIZE


def tiny_hf_config(family: str):
    """The transformers config of a tiny `family` model (architectures set, so AutoBridge accepts it)."""
    import transformers

    record = get_family(family)
    config_class = getattr(transformers, record.config_class)
    return config_class(
        text_config=copy.deepcopy(dict(record.tiny_text)),
        vision_config=copy.deepcopy(dict(record.tiny_vision)),
        **TINY_TOKEN_IDS,
        architectures=[record.hf_architecture],
    )


def write_tiny_hf_checkpoint(
    path: pathlib.Path,
    family: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    release: str | None = None,
) -> pathlib.Path:
    """Write a random tiny `family` model as an HF checkpoint directory with tokenizer and processor files; with
    the family's released multi-token-prediction head (`mtp.*`) where its config has one. `release`: a later release
    of the family (its record's `releases`, e.g. "3.6"): its on-disk expert layout and chat template."""
    import transformers

    chosen = get_family(family).release(release)
    packed_experts = bool(chosen and chosen.packed_experts)  # transformers saves experts per expert
    path = pathlib.Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_hf_config(family), dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to exactly 1 and biases to 0: perturb them so parity tests see them
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    layers = getattr(model.config.get_text_config(), "mtp_num_hidden_layers", 0) or 0
    if (
        layers
    ):  # transformers builds no MTP module: the head is written beside the model, as released checkpoints have it
        write_mtp_tensors(path, mtp_tensors(model, layers, packed=packed_experts))
    if packed_experts:
        pack_checkpoint_experts(path)
    write_tiny_hf_processor_dir(path, family, vocab_size=VOCAB_SIZE, release=release)
    return path


def mtp_tensors(model, layers: int, *, packed: bool) -> dict[str, torch.Tensor]:
    """A random multi-token-prediction head for `model` as checkpoint tensors (`mtp.*`), norms perturbed."""
    from qvl.bridges.mtp_reference import mtp_head_for, to_disk_layout

    head = mtp_head_for(model, layers)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return to_disk_layout(head.state_dict(), packed=packed)


def write_mtp_tensors(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to a saved checkpoint: into its one weights file, or as a shard listed in its index."""
    from safetensors.torch import load_file, save_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        content = json.loads(index.read_text())
        content["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index.write_text(json.dumps(content, indent=2, sort_keys=True))
        return
    weights = path / "model.safetensors"
    save_file(load_file(str(weights)) | tensors, str(weights), metadata={"format": "pt"})


def pack_checkpoint_experts(path: pathlib.Path) -> None:
    """Rewrite a one-file checkpoint's per-expert MoE tensors packed (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]), the layout Qwen3.6 checkpoints ship."""
    from safetensors.torch import load_file, save_file

    from qvl.bridges.mtp_reference import pack_experts

    weights = path / "model.safetensors"
    save_file(pack_experts(load_file(str(weights))), str(weights), metadata={"format": "pt"})
