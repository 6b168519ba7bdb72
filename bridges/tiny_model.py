"""The debug flavour as a checkpoint: a tiny random HF model of any family, for tests, the demo and benchmarks.

The shapes are each family's `tiny_text` / `tiny_vision` (qvl.foundation.families): the real block structure
(Qwen2-VL's LayerNorm/non-gated vision MLP, Qwen2.5-VL's window attention and full-attention blocks, Qwen3-VL's
deepstack and learned vision position embedding, Qwen3-VL-MoE's experts) at widths of 32-64. Token ids come
from the tiny tokenizer of `qvl.foundation.tiny_processor`, whose special tokens are ids 0-6. No hub access.
"""

from __future__ import annotations

import copy
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
    path: pathlib.Path, family: str, *, seed: int = 0, max_shard_size: str | None = None
) -> pathlib.Path:
    """Write a random tiny `family` model as an HF checkpoint directory with tokenizer and processor files."""
    import transformers

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_hf_config(family), dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to exactly 1 and biases to 0: perturb them so parity tests see them
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_tiny_hf_processor_dir(path, family, vocab_size=VOCAB_SIZE)
    return path
