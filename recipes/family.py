"""What a family module needs to define its recipes, without importing Megatron-Bridge: listing the recipes
(`qvl recipes`, `nemo qvl --help`, a recipe name's lookup) imports the family modules, and only building a recipe's
config imports Megatron-Bridge (qvl.recipes.base)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qvl.recipes.architectures import Architecture
from qvl.recipes.options import STAGE_DEFAULTS, make_options

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

# Non-layout defaults per (size, stage) for the large dense models (Qwen2-VL, Qwen2.5-VL). Their stage 0 holds
# several packs in flight, each with its images' replicated HF vision activations: about 1.5 MB per patch on a GPU
# (activations.HF_COMPILED_TOWER_BYTES, measured; 32B fits its default layout without recompute by 2 GiB, too close
# to the planner's error), so the tower recomputes its blocks; at 72B the LM recomputes too.
DENSE_LARGE_SETTINGS: dict[tuple[str, str], dict] = {
    ("32b", "pretrain"): dict(vision_recompute=True),
    ("32b", "sft"): dict(vision_recompute=True),
    ("72b", "pretrain"): dict(recompute="full", vision_recompute=True),
    ("72b", "sft"): dict(recompute="full", vision_recompute=True),
}


# A preference stage trains from the stage before it and holds what that stage holds: full DPO what SFT holds (its
# reference log-probs precomputed, a pair's two sequences inside one pack), DPO on adapters what PEFT holds.
PREFERENCE_BASE = {"dpo": "sft", "dpo_peft": "peft"}
# Options a preference stage does not take from its base stage: the MTP head is off for DPO (qvl.recipes.base).
NOT_FOR_PREFERENCE = ("mtp",)


def with_preference_stages(table: dict[tuple[str, str], dict]) -> dict[tuple[str, str], dict]:
    """A family's per-(size, stage) table (DEFAULTS or SETTINGS) with each size's `dpo` and `dpo_peft` entries, taken
    from its `sft` and `peft` entries."""
    added = {
        (size, preference): {k: v for k, v in table[size, base].items() if k not in NOT_FOR_PREFERENCE}
        for preference, base in PREFERENCE_BASE.items()
        for size, stage in table
        if stage == base
    }
    return {**table, **added}


def family_recipe(
    *, arch: Architecture, stage: str, planned: dict[str, int], settings: dict, overrides: dict
) -> ConfigContainer:
    """What every family's base recipe does: stage defaults, the size's planned layout (`gpus` is the registry's) and
    settings, the caller's overrides."""
    run = f"{arch.family}-{arch.size}-{stage}"
    defaults = {
        **STAGE_DEFAULTS[stage],
        **{k: v for k, v in planned.items() if k != "gpus"},
        **settings,
        "hf_path": arch.hub_id,
        "checkpoint_dir": f"experiments/{run}/checkpoints",
        "tensorboard_dir": f"experiments/{run}/tensorboard",
    }
    from qvl.recipes.base import build_config  # imports Megatron-Bridge

    return build_config(arch=arch, stage=stage, options=make_options(defaults, overrides))
