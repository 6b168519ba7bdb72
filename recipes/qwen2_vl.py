"""Qwen2-VL recipes (2B, 7B, 72B) x (pretrain, sft, peft, dpo, dpo_peft): one base recipe, small size/stage functions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qvl.recipes.architectures import get_architecture
from qvl.recipes.family import DENSE_LARGE_SETTINGS, family_recipe, with_preference_stages
from qvl.recipes.registry import recipe

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

FAMILY = "qwen2_vl"
# Per (size, stage): the default parallel layout and the GPU count it was planned for (`gpus`); it fits H100 80 GB
# at 4096-token packs on that many GPUs (tests/recipes plan them).
DEFAULTS: dict[tuple[str, str], dict[str, int]] = {
    ("2b", "pretrain"): dict(tensor_parallel=1, gpus=8),
    ("2b", "sft"): dict(tensor_parallel=1, gpus=8),
    ("2b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("7b", "pretrain"): dict(tensor_parallel=2, gpus=8),
    ("7b", "sft"): dict(tensor_parallel=2, gpus=8),
    ("7b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("72b", "pretrain"): dict(tensor_parallel=8, pipeline_parallel=4, gpus=64),
    ("72b", "sft"): dict(tensor_parallel=8, pipeline_parallel=4, gpus=64),
    ("72b", "peft"): dict(tensor_parallel=8, gpus=8),
}
SETTINGS = with_preference_stages(DENSE_LARGE_SETTINGS)
DEFAULTS = with_preference_stages(DEFAULTS)


def qwen2_vl(*, size: str, stage: str, **overrides: Any) -> ConfigContainer:
    """Base recipe: Qwen2-VL at `size` trained at `stage`, with the size's default layout under `overrides`."""
    return family_recipe(
        arch=get_architecture(FAMILY, size),
        stage=stage,
        planned=DEFAULTS[size, stage],
        settings=SETTINGS.get((size, stage), {}),
        overrides=overrides,
    )


@recipe(family=FAMILY, size="2b", stage="pretrain", **DEFAULTS["2b", "pretrain"])
def qwen2_vl_2b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-2B continued pretraining."""
    return qwen2_vl(size="2b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="2b", stage="sft", **DEFAULTS["2b", "sft"])
def qwen2_vl_2b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-2B full fine-tuning."""
    return qwen2_vl(size="2b", stage="sft", **overrides)


@recipe(family=FAMILY, size="2b", stage="peft", **DEFAULTS["2b", "peft"])
def qwen2_vl_2b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-2B LoRA fine-tuning."""
    return qwen2_vl(size="2b", stage="peft", **overrides)


@recipe(family=FAMILY, size="2b", stage="dpo", **DEFAULTS["2b", "dpo"])
def qwen2_vl_2b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-2B preference training (DPO), full fine-tuning."""
    return qwen2_vl(size="2b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="2b", stage="dpo_peft", **DEFAULTS["2b", "dpo_peft"])
def qwen2_vl_2b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-2B preference training (DPO) on LoRA adapters."""
    return qwen2_vl(size="2b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="7b", stage="pretrain", **DEFAULTS["7b", "pretrain"])
def qwen2_vl_7b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-7B continued pretraining."""
    return qwen2_vl(size="7b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="7b", stage="sft", **DEFAULTS["7b", "sft"])
def qwen2_vl_7b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-7B full fine-tuning."""
    return qwen2_vl(size="7b", stage="sft", **overrides)


@recipe(family=FAMILY, size="7b", stage="peft", **DEFAULTS["7b", "peft"])
def qwen2_vl_7b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-7B LoRA fine-tuning."""
    return qwen2_vl(size="7b", stage="peft", **overrides)


@recipe(family=FAMILY, size="7b", stage="dpo", **DEFAULTS["7b", "dpo"])
def qwen2_vl_7b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-7B preference training (DPO), full fine-tuning."""
    return qwen2_vl(size="7b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="7b", stage="dpo_peft", **DEFAULTS["7b", "dpo_peft"])
def qwen2_vl_7b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-7B preference training (DPO) on LoRA adapters."""
    return qwen2_vl(size="7b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="72b", stage="pretrain", **DEFAULTS["72b", "pretrain"])
def qwen2_vl_72b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-72B continued pretraining."""
    return qwen2_vl(size="72b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="72b", stage="sft", **DEFAULTS["72b", "sft"])
def qwen2_vl_72b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-72B full fine-tuning."""
    return qwen2_vl(size="72b", stage="sft", **overrides)


@recipe(family=FAMILY, size="72b", stage="peft", **DEFAULTS["72b", "peft"])
def qwen2_vl_72b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-72B LoRA fine-tuning."""
    return qwen2_vl(size="72b", stage="peft", **overrides)


@recipe(family=FAMILY, size="72b", stage="dpo", **DEFAULTS["72b", "dpo"])
def qwen2_vl_72b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-72B preference training (DPO), full fine-tuning."""
    return qwen2_vl(size="72b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="72b", stage="dpo_peft", **DEFAULTS["72b", "dpo_peft"])
def qwen2_vl_72b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen2-VL-72B preference training (DPO) on LoRA adapters."""
    return qwen2_vl(size="72b", stage="dpo_peft", **overrides)
