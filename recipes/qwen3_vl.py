"""Qwen3-VL recipes, dense (2B, 4B, 8B, 32B) and MoE (30B-A3B, 235B-A22B) x (pretrain, sft, peft, dpo, dpo_peft)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qvl.recipes.architectures import get_architecture
from qvl.recipes.family import family_recipe, with_preference_stages
from qvl.recipes.registry import recipe

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

FAMILY = "qwen3_vl"
MOE_FAMILY = "qwen3_vl_moe"  # same base recipe; its checkpoints are a family of their own (HF class, bridge)
MOE_SIZES = ("30b-a3b", "235b-a22b")
# Per (size, stage): the default parallel layout and the GPU count it was planned for (`gpus`); it fits H100 80 GB
# at 4096-token packs on that many GPUs (tests/recipes plan them).
DEFAULTS: dict[tuple[str, str], dict[str, int]] = {
    ("2b", "pretrain"): dict(tensor_parallel=1, gpus=8),
    ("2b", "sft"): dict(tensor_parallel=1, gpus=8),
    ("2b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("4b", "pretrain"): dict(tensor_parallel=1, gpus=8),
    ("4b", "sft"): dict(tensor_parallel=1, gpus=8),
    ("4b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("8b", "pretrain"): dict(tensor_parallel=2, gpus=8),
    ("8b", "sft"): dict(tensor_parallel=2, gpus=8),
    ("8b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("32b", "pretrain"): dict(tensor_parallel=8, pipeline_parallel=2, gpus=16),
    ("32b", "sft"): dict(tensor_parallel=8, pipeline_parallel=2, gpus=16),
    ("32b", "peft"): dict(tensor_parallel=4, gpus=4),
    ("30b-a3b", "pretrain"): dict(tensor_parallel=2, expert_parallel=8, gpus=16),
    ("30b-a3b", "sft"): dict(tensor_parallel=2, expert_parallel=8, gpus=16),
    ("30b-a3b", "peft"): dict(tensor_parallel=1, expert_parallel=8, gpus=8),
    ("235b-a22b", "pretrain"): dict(tensor_parallel=4, pipeline_parallel=8, expert_parallel=8, gpus=256),
    ("235b-a22b", "sft"): dict(tensor_parallel=4, pipeline_parallel=8, expert_parallel=8, gpus=256),
    ("235b-a22b", "peft"): dict(tensor_parallel=4, pipeline_parallel=2, expert_parallel=8, gpus=64),
}
DEFAULTS = with_preference_stages(DEFAULTS)
SETTINGS: dict[tuple[str, str], dict] = {}  # non-layout defaults per (size, stage); none needed yet


def qwen3_vl(*, size: str, stage: str, **overrides: Any) -> ConfigContainer:
    """Base recipe: Qwen3-VL at `size` trained at `stage`, with the size's default layout under `overrides`."""
    return family_recipe(
        arch=get_architecture(MOE_FAMILY if size in MOE_SIZES else FAMILY, size),
        stage=stage,
        planned=DEFAULTS[size, stage],
        settings=SETTINGS.get((size, stage), {}),
        overrides=overrides,
    )


@recipe(family=FAMILY, size="2b", stage="pretrain", **DEFAULTS["2b", "pretrain"])
def qwen3_vl_2b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-2B continued pretraining."""
    return qwen3_vl(size="2b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="2b", stage="sft", **DEFAULTS["2b", "sft"])
def qwen3_vl_2b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-2B full fine-tuning."""
    return qwen3_vl(size="2b", stage="sft", **overrides)


@recipe(family=FAMILY, size="2b", stage="peft", **DEFAULTS["2b", "peft"])
def qwen3_vl_2b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-2B LoRA fine-tuning."""
    return qwen3_vl(size="2b", stage="peft", **overrides)


@recipe(family=FAMILY, size="2b", stage="dpo", **DEFAULTS["2b", "dpo"])
def qwen3_vl_2b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-2B preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="2b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="2b", stage="dpo_peft", **DEFAULTS["2b", "dpo_peft"])
def qwen3_vl_2b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-2B preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="2b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="4b", stage="pretrain", **DEFAULTS["4b", "pretrain"])
def qwen3_vl_4b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-4B continued pretraining."""
    return qwen3_vl(size="4b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="4b", stage="sft", **DEFAULTS["4b", "sft"])
def qwen3_vl_4b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-4B full fine-tuning."""
    return qwen3_vl(size="4b", stage="sft", **overrides)


@recipe(family=FAMILY, size="4b", stage="peft", **DEFAULTS["4b", "peft"])
def qwen3_vl_4b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-4B LoRA fine-tuning."""
    return qwen3_vl(size="4b", stage="peft", **overrides)


@recipe(family=FAMILY, size="4b", stage="dpo", **DEFAULTS["4b", "dpo"])
def qwen3_vl_4b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-4B preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="4b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="4b", stage="dpo_peft", **DEFAULTS["4b", "dpo_peft"])
def qwen3_vl_4b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-4B preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="4b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="8b", stage="pretrain", **DEFAULTS["8b", "pretrain"])
def qwen3_vl_8b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-8B continued pretraining."""
    return qwen3_vl(size="8b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="8b", stage="sft", **DEFAULTS["8b", "sft"])
def qwen3_vl_8b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-8B full fine-tuning."""
    return qwen3_vl(size="8b", stage="sft", **overrides)


@recipe(family=FAMILY, size="8b", stage="peft", **DEFAULTS["8b", "peft"])
def qwen3_vl_8b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-8B LoRA fine-tuning."""
    return qwen3_vl(size="8b", stage="peft", **overrides)


@recipe(family=FAMILY, size="8b", stage="dpo", **DEFAULTS["8b", "dpo"])
def qwen3_vl_8b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-8B preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="8b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="8b", stage="dpo_peft", **DEFAULTS["8b", "dpo_peft"])
def qwen3_vl_8b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-8B preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="8b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="32b", stage="pretrain", **DEFAULTS["32b", "pretrain"])
def qwen3_vl_32b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-32B continued pretraining."""
    return qwen3_vl(size="32b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="32b", stage="sft", **DEFAULTS["32b", "sft"])
def qwen3_vl_32b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-32B full fine-tuning."""
    return qwen3_vl(size="32b", stage="sft", **overrides)


@recipe(family=FAMILY, size="32b", stage="peft", **DEFAULTS["32b", "peft"])
def qwen3_vl_32b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-32B LoRA fine-tuning."""
    return qwen3_vl(size="32b", stage="peft", **overrides)


@recipe(family=FAMILY, size="32b", stage="dpo", **DEFAULTS["32b", "dpo"])
def qwen3_vl_32b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-32B preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="32b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="32b", stage="dpo_peft", **DEFAULTS["32b", "dpo_peft"])
def qwen3_vl_32b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-32B preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="32b", stage="dpo_peft", **overrides)


@recipe(family=MOE_FAMILY, size="30b-a3b", stage="pretrain", **DEFAULTS["30b-a3b", "pretrain"])
def qwen3_vl_30b_a3b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-30B-A3B (MoE) continued pretraining."""
    return qwen3_vl(size="30b-a3b", stage="pretrain", **overrides)


@recipe(family=MOE_FAMILY, size="30b-a3b", stage="sft", **DEFAULTS["30b-a3b", "sft"])
def qwen3_vl_30b_a3b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-30B-A3B (MoE) full fine-tuning."""
    return qwen3_vl(size="30b-a3b", stage="sft", **overrides)


@recipe(family=MOE_FAMILY, size="30b-a3b", stage="peft", **DEFAULTS["30b-a3b", "peft"])
def qwen3_vl_30b_a3b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-30B-A3B (MoE) LoRA fine-tuning."""
    return qwen3_vl(size="30b-a3b", stage="peft", **overrides)


@recipe(family=MOE_FAMILY, size="30b-a3b", stage="dpo", **DEFAULTS["30b-a3b", "dpo"])
def qwen3_vl_30b_a3b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-30B-A3B (MoE) preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="30b-a3b", stage="dpo", **overrides)


@recipe(family=MOE_FAMILY, size="30b-a3b", stage="dpo_peft", **DEFAULTS["30b-a3b", "dpo_peft"])
def qwen3_vl_30b_a3b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-30B-A3B (MoE) preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="30b-a3b", stage="dpo_peft", **overrides)


@recipe(family=MOE_FAMILY, size="235b-a22b", stage="pretrain", **DEFAULTS["235b-a22b", "pretrain"])
def qwen3_vl_235b_a22b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-235B-A22B (MoE) continued pretraining."""
    return qwen3_vl(size="235b-a22b", stage="pretrain", **overrides)


@recipe(family=MOE_FAMILY, size="235b-a22b", stage="sft", **DEFAULTS["235b-a22b", "sft"])
def qwen3_vl_235b_a22b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-235B-A22B (MoE) full fine-tuning."""
    return qwen3_vl(size="235b-a22b", stage="sft", **overrides)


@recipe(family=MOE_FAMILY, size="235b-a22b", stage="peft", **DEFAULTS["235b-a22b", "peft"])
def qwen3_vl_235b_a22b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-235B-A22B (MoE) LoRA fine-tuning."""
    return qwen3_vl(size="235b-a22b", stage="peft", **overrides)


@recipe(family=MOE_FAMILY, size="235b-a22b", stage="dpo", **DEFAULTS["235b-a22b", "dpo"])
def qwen3_vl_235b_a22b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-235B-A22B (MoE) preference training (DPO), full fine-tuning."""
    return qwen3_vl(size="235b-a22b", stage="dpo", **overrides)


@recipe(family=MOE_FAMILY, size="235b-a22b", stage="dpo_peft", **DEFAULTS["235b-a22b", "dpo_peft"])
def qwen3_vl_235b_a22b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3-VL-235B-A22B (MoE) preference training (DPO) on LoRA adapters."""
    return qwen3_vl(size="235b-a22b", stage="dpo_peft", **overrides)
