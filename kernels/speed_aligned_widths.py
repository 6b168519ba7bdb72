"""Aligned GEMM widths: a replicated HF vision tower's MLP width that is not a multiple of 64 is zero-padded.

Why: Qwen2.5-VL's vision MLP is 3420 wide, a 6,840-byte bf16 row pitch. Hopper's TMA needs 16-byte multiples, so
cuBLAS runs every gate/up/down GEMM of the tower (forward, dgrad, wgrad) in Ampere `align2` kernels, ~3x slower per
FLOP than the rest of the step (the H100 profile in benchmarks/results/h100-2026-11-23/profile.txt). Padded to 3456 (the next multiple of 64) the extra gate/up
rows, their biases and the extra down columns are zero, so each padded unit computes silu(0) * 0 = 0 and adds nothing
to the output; its gradients are exactly zero (the down column is zero, and the unit's activation is zero), so AdamW
(decoupled weight decay of a zero stays zero) keeps the padding zero through training. nanoGPT pads its vocabulary
the same way ("padded up to nearest multiple of 64 for efficiency", karpathy/nanoGPT model.py).

One mechanism, three places:
- build: `align_vision_widths(provider)` gives the provider a padded copy of its HF `vision_config` (the checkpoint's
  config object is never changed). Everything that builds the tower from the provider, or from the run_config.yaml
  a checkpoint carries, builds it padded; the planner's FLOPs and memory read the same config, so they count it.
- import (HF -> Megatron): `pad_to_parameter` zero-pads an HF tensor to its padded parameter (patch group
  `speed-aligned-widths` on Megatron-Bridge's `ReplicatedMapping.hf_to_megatron`, the mapping of `visual.**`).
- export and verify (Megatron -> HF): `mark_hf_widths(model, hf_config)` records on each padded layer the HF width
  read from the checkpoint's config; `strip_to_hf` (the same group, on `ReplicatedMapping.megatron_to_hf`) cuts the
  padding off, so the exported tensors are bit for bit the HF ones.

Megatron checkpoints hold the padded tensors. A checkpoint imported before padding existed holds 3420-wide ones and
no longer loads; import it again.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from qvl.foundation.families import family_of_vision_config

logger = logging.getLogger(__name__)

GROUP = "speed-aligned-widths"
ALIGNMENT = 64  # elements: a multiple of 64 keeps bf16/fp16 (and fp32) row pitches at a multiple of 128 bytes
# Attribute set on a padded layer by `mark_hf_widths`: {parameter name: (dimension, HF size)}.
HF_WIDTH_ATTRIBUTE = "qvl_hf_width"


@dataclass(kw_only=True, slots=True, frozen=True)
class PaddableMLP:
    """An HF MLP class whose hidden width is one config field: which layers widen to it and which narrows from it."""

    config_field: str  # the vision config field that sets the width
    widening: tuple[str, ...]  # Linear children whose output rows (and biases) are the width
    narrowing: str  # the Linear child whose input columns are the width


# transformers' vision MLP classes (5.12.1) whose width the config sets directly. Qwen2-VL's `VisionMlp` takes
# embed_dim * mlp_ratio (an int ratio, validated), which cannot be padded through its config; its published width
# (1280 x 4 = 5120) is aligned already.
PADDABLE_MLPS: dict[str, PaddableMLP] = {
    "Qwen2_5_VLMLP": PaddableMLP(
        config_field="intermediate_size", widening=("gate_proj", "up_proj"), narrowing="down_proj"
    ),
}
_WIDTH_FIELDS = tuple(dict.fromkeys(m.config_field for m in PADDABLE_MLPS.values()))


def aligned(width: int) -> int:
    """`width` rounded up to a multiple of ALIGNMENT."""
    return -(-int(width) // ALIGNMENT) * ALIGNMENT


def padded_vision_config(vision_config: Any) -> tuple[Any, dict[str, tuple[int, int]]]:
    """A copy of an HF vision config with every misaligned MLP width padded, and {field: (HF width, padded)}.

    Returns the config itself (and {}) where nothing needs padding or the tower is not an HF one (Qwen3-VL's
    Megatron tower is built from Megatron fields, not from this config's widths)."""
    family = family_of_vision_config(type(vision_config).__name__)
    if family is None or family.megatron_vision_tower:
        return vision_config, {}
    changes = {
        name: (width, aligned(width))
        for name in _WIDTH_FIELDS
        if isinstance(width := getattr(vision_config, name, None), int) and width % ALIGNMENT
    }
    if not changes:
        return vision_config, {}
    padded = copy.deepcopy(vision_config)
    for name, (_, width) in changes.items():
        setattr(padded, name, width)
    return padded, changes


def align_vision_widths(provider: Any) -> dict[str, tuple[int, int]]:
    """Give a provider's replicated HF vision tower aligned MLP widths (in place); what was padded.

    Also registers a pre-wrap hook (Megatron-Bridge's extension point) that zeroes the padding after the model's own
    initialisation (HF initialises every row of a Linear) and marks the padded layers with their HF widths."""
    vision = getattr(provider, "vision_config", None)
    if vision is None:
        return {}
    padded, changes = padded_vision_config(vision)
    if changes:
        provider.vision_config = padded
        provider.register_pre_wrap_hook(functools.partial(zero_padding, changes=changes))
        for name, (width, to) in changes.items():
            logger.info("vision %s %d -> %d (zero-padded to a multiple of %d)", name, width, to, ALIGNMENT)
    return changes


def vision_width_changes(tower_config: Any, hf_vision_config: Any) -> dict[str, tuple[int, int]]:
    """{field: (HF width, built width)} where a built tower's config is wider than the checkpoint's."""
    changes = {}
    for name in _WIDTH_FIELDS:
        built, hf = getattr(tower_config, name, None), getattr(hf_vision_config, name, None)
        if isinstance(built, int) and isinstance(hf, int) and built != hf:
            if built != aligned(hf):
                raise ValueError(
                    f"the model's vision {name} is {built}, the checkpoint's config.json says {hf} "
                    f"(padded: {aligned(hf)}); the Megatron checkpoint was not made from this HF config"
                )
            changes[name] = (hf, built)
    return changes


def _padded_mlps(tower: torch.nn.Module, changes: dict[str, tuple[int, int]]) -> Iterator[tuple[Any, PaddableMLP, int]]:
    """(MLP module, its kind, its HF width) for every MLP of `tower` whose width field was padded."""
    for mlp in tower.modules():
        kind = PADDABLE_MLPS.get(type(mlp).__name__)
        if kind is not None and kind.config_field in changes:
            yield mlp, kind, changes[kind.config_field][0]


def _mark(mlp: Any, kind: PaddableMLP, width: int) -> None:
    for name in kind.widening:
        layer = getattr(mlp, name)
        setattr(layer, HF_WIDTH_ATTRIBUTE, {p: (0, width) for p, _ in layer.named_parameters()})
    setattr(getattr(mlp, kind.narrowing), HF_WIDTH_ATTRIBUTE, {"weight": (1, width)})


def zero_padding(model_chunks: list[torch.nn.Module], *, changes: dict[str, tuple[int, int]]) -> list:
    """Pre-wrap hook: the padding of every padded MLP is zero (rows, biases, columns) and marked for export."""
    for tower in hf_vision_towers(model_chunks):
        for mlp, kind, width in _padded_mlps(tower, changes):
            with torch.no_grad():
                for name in kind.widening:
                    for param in getattr(mlp, name).parameters():
                        param[width:].zero_()
                getattr(mlp, kind.narrowing).weight[:, width:].zero_()
            _mark(mlp, kind, width)
    return model_chunks


def mark_hf_widths(model_chunks: list[torch.nn.Module], hf_config: Any) -> int:
    """Record the checkpoint's (unpadded) widths on each padded layer of the model's HF vision towers, so the export
    strips the padding (a model built from a checkpoint's run_config.yaml has no pre-wrap hook); layers marked."""
    hf_vision = getattr(hf_config, "vision_config", hf_config)
    marked = 0
    for tower in hf_vision_towers(model_chunks):
        for mlp, kind, width in _padded_mlps(tower, vision_width_changes(tower.config, hf_vision)):
            _mark(mlp, kind, width)
            marked += len(kind.widening) + 1
    return marked


def hf_vision_towers(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The replicated HF vision towers (Qwen2-VL, Qwen2.5-VL) in a list of model chunks."""
    from transformers import PreTrainedModel

    towers = []
    for chunk in model_chunks:
        for module in chunk.modules():
            family = (
                family_of_vision_config(type(module.config).__name__) if isinstance(module, PreTrainedModel) else None
            )
            if family is not None and not family.megatron_vision_tower:
                towers.append(module)
    return towers


def _padded_axis(name: str) -> int | None:
    """The axis of `name` (a Megatron parameter name) that an MLP width sets, or None for any other parameter."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    layer, param = parts[-2], parts[-1]
    for kind in PADDABLE_MLPS.values():
        if layer in kind.widening and param in ("weight", "bias"):
            return 0
        if layer == kind.narrowing and param == "weight":
            return 1
    return None


def pad_to_parameter(name: str, hf_tensor: torch.Tensor, target_shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """`hf_tensor` zero-padded to `target_shape` when `name` is a padded MLP layer's parameter and the target is the
    aligned width; anything else is returned unchanged (a real mismatch is reported where shapes are checked)."""
    target_shape = tuple(target_shape)
    axis = _padded_axis(name)
    if axis is None or hf_tensor.dim() != len(target_shape) or tuple(hf_tensor.shape) == target_shape:
        return hf_tensor
    same_elsewhere = all(hf_tensor.shape[d] == target_shape[d] for d in range(hf_tensor.dim()) if d != axis)
    if not same_elsewhere or target_shape[axis] != aligned(hf_tensor.shape[axis]):
        return hf_tensor
    pad = [0, 0] * hf_tensor.dim()
    pad[2 * (hf_tensor.dim() - 1 - axis) + 1] = target_shape[axis] - hf_tensor.shape[axis]
    return torch.nn.functional.pad(hf_tensor, pad)


def strip_to_hf(module: torch.nn.Module | None, name: str, weights: torch.Tensor | None) -> torch.Tensor | None:
    """`weights` (a parameter of `module`) cut back to the HF width recorded by `mark_hf_widths`, else unchanged."""
    marks = getattr(module, HF_WIDTH_ATTRIBUTE, None) if module is not None else None
    if weights is None or not marks:
        return weights
    axis_width = marks.get(name.rsplit(".", 1)[-1])
    if axis_width is None:
        return weights
    axis, width = axis_width
    return weights.narrow(axis, 0, width).contiguous()


# --- patch group `speed-aligned-widths` (qvl.foundation.patches): Megatron-Bridge's mapping of the replicated `visual.**`


def padding_hf_to_megatron(original):
    """ReplicatedMapping.hf_to_megatron that zero-pads an HF tensor to its padded parameter first."""

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: torch.nn.Module) -> torch.Tensor:
        name = str(self.megatron_param)
        target = getattr(megatron_module, name.rsplit(".", 1)[-1], None)
        if isinstance(target, torch.Tensor) and isinstance(hf_weights, torch.Tensor):
            hf_weights = pad_to_parameter(name, hf_weights, target.shape)
        return original(self, hf_weights, megatron_module)

    return hf_to_megatron


def stripping_megatron_to_hf(original):
    """ReplicatedMapping.megatron_to_hf that cuts a padded parameter back to the checkpoint's width first."""

    def megatron_to_hf(self, megatron_weights, megatron_module):
        return original(self, strip_to_hf(megatron_module, str(self.megatron_param), megatron_weights), megatron_module)

    return megatron_to_hf
