"""Qwen3.5-VL recipes, dense (9B, 27B) and MoE (35B-A3B, 397B-A17B) x (pretrain, sft, peft, dpo, dpo_peft), and the later releases
of the same architecture users fine-tune: Qwen3.6 (27B, 35B-A3B) and Qwen3.8 (27B).

Default layouts start from Megatron-Bridge 0.6.2's H100 recipes for the same sizes
(megatron/bridge/recipes/qwen_vl/h100/qwen35_vl.py: 9B SFT at TP=4 on 4 GPUs, 27B SFT at TP=4 x PP=4 on 16, 27B LoRA
at TP=2 on 2) and are changed where qvl's layout check or `qvl plan` refuses them: the MoE models have 2 KV heads
(TP <= 2), and qvl counts expert parallelism inside TP x DP (so 397B-A17B full training takes 512 GPUs, as
Megatron-Bridge's 397B pretraining recipe does). Every default is planned to fit H100 80 GB at 4096-token packs
(tests/recipes/test_planner.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qvl.recipes.architectures import get_architecture
from qvl.recipes.family import family_recipe, with_preference_stages
from qvl.recipes.registry import recipe

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

FAMILY = "qwen3_5_vl"
MOE_FAMILY = "qwen3_5_vl_moe"  # same base recipe; its checkpoints are a family of their own (HF class, bridge)
MOE_SIZES = ("35b-a3b", "397b-a17b", "3.6-35b-a3b")
# Per (size, stage): the default parallel layout and the GPU count it was planned for (`gpus`); it fits H100 80 GB
# at 4096-token packs on that many GPUs (tests/recipes plan them).
DEFAULTS: dict[tuple[str, str], dict[str, int]] = {
    ("9b", "pretrain"): dict(tensor_parallel=4, gpus=4),
    ("9b", "sft"): dict(tensor_parallel=4, gpus=4),
    ("9b", "peft"): dict(tensor_parallel=1, gpus=1),
    ("27b", "pretrain"): dict(tensor_parallel=4, pipeline_parallel=4, gpus=16),
    ("27b", "sft"): dict(tensor_parallel=4, pipeline_parallel=4, gpus=16),
    ("27b", "peft"): dict(tensor_parallel=2, gpus=2),
    # 2 KV heads: TP <= 2 (Megatron-Bridge's TP=4 MoE recipes split KV heads qvl's layout check refuses).
    ("35b-a3b", "pretrain"): dict(tensor_parallel=2, expert_parallel=8, gpus=16),
    ("35b-a3b", "sft"): dict(tensor_parallel=2, expert_parallel=8, gpus=16),
    ("35b-a3b", "peft"): dict(tensor_parallel=2, expert_parallel=4, gpus=8),
    ("397b-a17b", "pretrain"): dict(tensor_parallel=2, pipeline_parallel=8, expert_parallel=32, gpus=512),
    ("397b-a17b", "sft"): dict(tensor_parallel=2, pipeline_parallel=8, expert_parallel=32, gpus=512),
    ("397b-a17b", "peft"): dict(tensor_parallel=2, pipeline_parallel=4, expert_parallel=16, gpus=128),
}
# Qwen3.6 and Qwen3.8 (the family records' releases): the same shapes as Qwen3.5's sizes, so the same layouts.
SAME_SHAPE = {"3.6-27b": "27b", "3.6-35b-a3b": "35b-a3b", "3.8-27b": "27b"}
DEFAULTS |= {
    (size, stage): DEFAULTS[base, stage] for size, base in SAME_SHAPE.items() for stage in ("pretrain", "sft", "peft")
}
# Non-layout defaults per (size, stage): the checkpoint's multi-token-prediction layer trains in SFT and PEFT where
# the checkpoint has one, as in Megatron-Bridge's Qwen3.5-VL recipes (mtp_num_layers 1, mtp_loss_scaling_factor 0.1),
# and none is built where it has none (transformers saves no `mtp.*`); pretraining leaves it aside
# (qvl.recipes.base._apply_mtp).
SETTINGS: dict[tuple[str, str], dict] = {
    (size, stage): dict(mtp=None) for size, _ in DEFAULTS for stage in ("sft", "peft")
}
DEFAULTS = with_preference_stages(DEFAULTS)
SETTINGS = with_preference_stages(SETTINGS)


def qwen3_5_vl(*, size: str, stage: str, **overrides: Any) -> ConfigContainer:
    """Base recipe: Qwen3.5-VL at `size` trained at `stage`, with the size's default layout under `overrides`."""
    return family_recipe(
        arch=get_architecture(MOE_FAMILY if size in MOE_SIZES else FAMILY, size),
        stage=stage,
        planned=DEFAULTS[size, stage],
        settings=SETTINGS.get((size, stage), {}),
        overrides=overrides,
    )


@recipe(family=FAMILY, size="9b", stage="pretrain", **DEFAULTS["9b", "pretrain"])
def qwen3_5_vl_9b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-9B continued pretraining."""
    return qwen3_5_vl(size="9b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="9b", stage="sft", **DEFAULTS["9b", "sft"])
def qwen3_5_vl_9b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-9B full fine-tuning."""
    return qwen3_5_vl(size="9b", stage="sft", **overrides)


@recipe(family=FAMILY, size="9b", stage="peft", **DEFAULTS["9b", "peft"])
def qwen3_5_vl_9b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-9B LoRA fine-tuning."""
    return qwen3_5_vl(size="9b", stage="peft", **overrides)


@recipe(family=FAMILY, size="9b", stage="dpo", **DEFAULTS["9b", "dpo"])
def qwen3_5_vl_9b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-9B preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="9b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="9b", stage="dpo_peft", **DEFAULTS["9b", "dpo_peft"])
def qwen3_5_vl_9b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-9B preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="9b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="27b", stage="pretrain", **DEFAULTS["27b", "pretrain"])
def qwen3_5_vl_27b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-27B continued pretraining."""
    return qwen3_5_vl(size="27b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="27b", stage="sft", **DEFAULTS["27b", "sft"])
def qwen3_5_vl_27b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-27B full fine-tuning."""
    return qwen3_5_vl(size="27b", stage="sft", **overrides)


@recipe(family=FAMILY, size="27b", stage="peft", **DEFAULTS["27b", "peft"])
def qwen3_5_vl_27b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-27B LoRA fine-tuning."""
    return qwen3_5_vl(size="27b", stage="peft", **overrides)


@recipe(family=FAMILY, size="27b", stage="dpo", **DEFAULTS["27b", "dpo"])
def qwen3_5_vl_27b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-27B preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="27b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="27b", stage="dpo_peft", **DEFAULTS["27b", "dpo_peft"])
def qwen3_5_vl_27b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-27B preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="27b", stage="dpo_peft", **overrides)


@recipe(family=MOE_FAMILY, size="35b-a3b", stage="pretrain", **DEFAULTS["35b-a3b", "pretrain"])
def qwen3_5_vl_35b_a3b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-35B-A3B (MoE) continued pretraining."""
    return qwen3_5_vl(size="35b-a3b", stage="pretrain", **overrides)


@recipe(family=MOE_FAMILY, size="35b-a3b", stage="sft", **DEFAULTS["35b-a3b", "sft"])
def qwen3_5_vl_35b_a3b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-35B-A3B (MoE) full fine-tuning."""
    return qwen3_5_vl(size="35b-a3b", stage="sft", **overrides)


@recipe(family=MOE_FAMILY, size="35b-a3b", stage="peft", **DEFAULTS["35b-a3b", "peft"])
def qwen3_5_vl_35b_a3b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-35B-A3B (MoE) LoRA fine-tuning."""
    return qwen3_5_vl(size="35b-a3b", stage="peft", **overrides)


@recipe(family=MOE_FAMILY, size="35b-a3b", stage="dpo", **DEFAULTS["35b-a3b", "dpo"])
def qwen3_5_vl_35b_a3b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-35B-A3B (MoE) preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="35b-a3b", stage="dpo", **overrides)


@recipe(family=MOE_FAMILY, size="35b-a3b", stage="dpo_peft", **DEFAULTS["35b-a3b", "dpo_peft"])
def qwen3_5_vl_35b_a3b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-35B-A3B (MoE) preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="35b-a3b", stage="dpo_peft", **overrides)


@recipe(family=MOE_FAMILY, size="397b-a17b", stage="pretrain", **DEFAULTS["397b-a17b", "pretrain"])
def qwen3_5_vl_397b_a17b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-397B-A17B (MoE) continued pretraining."""
    return qwen3_5_vl(size="397b-a17b", stage="pretrain", **overrides)


@recipe(family=MOE_FAMILY, size="397b-a17b", stage="sft", **DEFAULTS["397b-a17b", "sft"])
def qwen3_5_vl_397b_a17b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-397B-A17B (MoE) full fine-tuning."""
    return qwen3_5_vl(size="397b-a17b", stage="sft", **overrides)


@recipe(family=MOE_FAMILY, size="397b-a17b", stage="peft", **DEFAULTS["397b-a17b", "peft"])
def qwen3_5_vl_397b_a17b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-397B-A17B (MoE) LoRA fine-tuning."""
    return qwen3_5_vl(size="397b-a17b", stage="peft", **overrides)


@recipe(family=MOE_FAMILY, size="397b-a17b", stage="dpo", **DEFAULTS["397b-a17b", "dpo"])
def qwen3_5_vl_397b_a17b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-397B-A17B (MoE) preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="397b-a17b", stage="dpo", **overrides)


@recipe(family=MOE_FAMILY, size="397b-a17b", stage="dpo_peft", **DEFAULTS["397b-a17b", "dpo_peft"])
def qwen3_5_vl_397b_a17b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.5-VL-397B-A17B (MoE) preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="397b-a17b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="3.6-27b", stage="pretrain", **DEFAULTS["3.6-27b", "pretrain"])
def qwen3_6_vl_27b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-27B continued pretraining."""
    return qwen3_5_vl(size="3.6-27b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="3.6-27b", stage="sft", **DEFAULTS["3.6-27b", "sft"])
def qwen3_6_vl_27b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-27B full fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.6-27b", stage="sft", **overrides)


@recipe(family=FAMILY, size="3.6-27b", stage="peft", **DEFAULTS["3.6-27b", "peft"])
def qwen3_6_vl_27b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-27B LoRA fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.6-27b", stage="peft", **overrides)


@recipe(family=FAMILY, size="3.6-27b", stage="dpo", **DEFAULTS["3.6-27b", "dpo"])
def qwen3_6_vl_27b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-27B preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="3.6-27b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="3.6-27b", stage="dpo_peft", **DEFAULTS["3.6-27b", "dpo_peft"])
def qwen3_6_vl_27b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-27B preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="3.6-27b", stage="dpo_peft", **overrides)


@recipe(family=MOE_FAMILY, size="3.6-35b-a3b", stage="pretrain", **DEFAULTS["3.6-35b-a3b", "pretrain"])
def qwen3_6_vl_35b_a3b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-35B-A3B (MoE) continued pretraining."""
    return qwen3_5_vl(size="3.6-35b-a3b", stage="pretrain", **overrides)


@recipe(family=MOE_FAMILY, size="3.6-35b-a3b", stage="sft", **DEFAULTS["3.6-35b-a3b", "sft"])
def qwen3_6_vl_35b_a3b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-35B-A3B (MoE) full fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.6-35b-a3b", stage="sft", **overrides)


@recipe(family=MOE_FAMILY, size="3.6-35b-a3b", stage="peft", **DEFAULTS["3.6-35b-a3b", "peft"])
def qwen3_6_vl_35b_a3b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-35B-A3B (MoE) LoRA fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.6-35b-a3b", stage="peft", **overrides)


@recipe(family=MOE_FAMILY, size="3.6-35b-a3b", stage="dpo", **DEFAULTS["3.6-35b-a3b", "dpo"])
def qwen3_6_vl_35b_a3b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-35B-A3B (MoE) preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="3.6-35b-a3b", stage="dpo", **overrides)


@recipe(family=MOE_FAMILY, size="3.6-35b-a3b", stage="dpo_peft", **DEFAULTS["3.6-35b-a3b", "dpo_peft"])
def qwen3_6_vl_35b_a3b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.6-35B-A3B (MoE) preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="3.6-35b-a3b", stage="dpo_peft", **overrides)


@recipe(family=FAMILY, size="3.8-27b", stage="pretrain", **DEFAULTS["3.8-27b", "pretrain"])
def qwen3_8_vl_27b_pretrain(**overrides: Any) -> ConfigContainer:
    """Qwen3.8-27B continued pretraining."""
    return qwen3_5_vl(size="3.8-27b", stage="pretrain", **overrides)


@recipe(family=FAMILY, size="3.8-27b", stage="sft", **DEFAULTS["3.8-27b", "sft"])
def qwen3_8_vl_27b_sft(**overrides: Any) -> ConfigContainer:
    """Qwen3.8-27B full fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.8-27b", stage="sft", **overrides)


@recipe(family=FAMILY, size="3.8-27b", stage="peft", **DEFAULTS["3.8-27b", "peft"])
def qwen3_8_vl_27b_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.8-27B LoRA fine-tuning (MTP trained where the checkpoint has a head)."""
    return qwen3_5_vl(size="3.8-27b", stage="peft", **overrides)


@recipe(family=FAMILY, size="3.8-27b", stage="dpo", **DEFAULTS["3.8-27b", "dpo"])
def qwen3_8_vl_27b_dpo(**overrides: Any) -> ConfigContainer:
    """Qwen3.8-27B preference training (DPO), full fine-tuning."""
    return qwen3_5_vl(size="3.8-27b", stage="dpo", **overrides)


@recipe(family=FAMILY, size="3.8-27b", stage="dpo_peft", **DEFAULTS["3.8-27b", "dpo_peft"])
def qwen3_8_vl_27b_dpo_peft(**overrides: Any) -> ConfigContainer:
    """Qwen3.8-27B preference training (DPO) on LoRA adapters."""
    return qwen3_5_vl(size="3.8-27b", stage="dpo_peft", **overrides)
