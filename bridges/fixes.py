"""Corrections qvl applies on top of Megatron-Bridge 0.6.2's Qwen-VL bridges.

Upstream behaviour worked around here (megatron-bridge 0.6.2):
- `Qwen25VLBridge.provider_bridge` never copies `mrope_section` from the HF config: the provider keeps
  its dataclass default [16, 24, 24], which is wrong for any checkpoint with another head size.
- `Qwen25VLBridge` and `Qwen3VLBridge` read token ids and `mrope_section` with `getattr(..., default)`
  fallbacks to the released models' values, so a checkpoint missing a field silently gets Qwen's ids.
  qvl reads every such field from the checkpoint's config and fails naming the field if it is absent.
- A replicated HF vision tower's MLP width that is not a multiple of 64 (Qwen2.5-VL's 3420) is built zero-padded
  (qvl.kernels.speed_aligned_widths), so its GEMMs run in aligned kernels.
- The providers' default layer spec is Transformer Engine's; without TE (CPU, or a GPU without TE)
  qvl switches to Megatron-Core's local spec with qvl's SDPA attention, which also handles packed (THD)
  sequences.
"""

from __future__ import annotations

import logging
from typing import Any

from qvl.foundation.errors import MissingConfigField
from qvl.foundation.megatron import have_transformer_engine, no_te_settings
from qvl.kernels.local_specs import local_gpt_layer_spec
from qvl.kernels.speed_aligned_widths import align_vision_widths
from qvl.kernels.torch_checkpoint_without_output import provide_checkpoints
from qvl.kernels.torch_sequence_parallel_norm import provide_norms

logger = logging.getLogger(__name__)

# Provider field -> HF top-level config field, read for every Qwen-VL family.
_TOKEN_ID_FIELDS = {
    "image_token_id": "image_token_id",
    "video_token_id": "video_token_id",
    "vision_start_token_id": "vision_start_token_id",
    "vision_end_token_id": "vision_end_token_id",
}


def required(config: Any, name: str, where: str) -> Any:
    """`config.name`, or an error naming the field and the file it belongs in."""
    value = getattr(config, name, None)
    if value is None:
        raise MissingConfigField(f"{where} has no {name!r}; add it to the checkpoint's config.json")
    return value


def mrope_section(text_config: Any) -> list[int]:
    """The checkpoint's mRoPE section sizes (t, h, w), validated against the head size."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    section = rope.get("mrope_section")
    if section is None:
        raise MissingConfigField("text_config.rope_parameters has no 'mrope_section'; add it to config.json")
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    # Qwen3.5 rotates only partial_rotary_factor (0.25) of each head: its sections cover that part.
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if sum(section) * 2 != rotary_dim:
        raise ValueError(
            f"mrope_section {section} sums to {sum(section)}, but rotary dimension {rotary_dim} "
            f"(head_dim {head_dim} x partial_rotary_factor) needs {rotary_dim // 2}"
        )
    return list(section)


def fix_provider(provider: Any, hf_config: Any) -> None:
    """Apply every correction above to a freshly bridged provider, in place."""
    text_config = getattr(hf_config, "text_config", hf_config)
    if getattr(provider, "position_embedding_type", None) == "mrope":
        provider.mrope_section = mrope_section(text_config)
    set_token_ids(provider, hf_config)
    align_vision_widths(
        provider
    )  # aligned GEMMs: Qwen2.5-VL's vision MLP 3420 -> 3456 (qvl.kernels.speed_aligned_widths)
    if not have_transformer_engine():
        use_local_specs(provider)


def use_local_specs(provider: Any) -> None:
    """Build the language model from Megatron-Core's local spec with SDPA attention (no TE needed), its torch norms
    able to take sequence parallelism (qvl.kernels.torch_sequence_parallel_norm) and its selective recompute's
    checkpoints without FP8 (qvl.kernels.torch_checkpoint_without_output)."""
    provide_norms()
    provide_checkpoints()
    provider.transformer_layer_spec = local_gpt_layer_spec
    for name, value in no_te_settings().items():
        setattr(provider, name, value)


def set_token_ids(provider: Any, hf_config: Any) -> None:
    """The provider's vision token ids, read from the checkpoint's config.json (never Qwen's released values)."""
    for provider_field, hf_field in _TOKEN_ID_FIELDS.items():
        if hasattr(provider, provider_field):
            setattr(provider, provider_field, required(hf_config, hf_field, "config.json"))
