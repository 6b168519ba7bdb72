"""The planner's PEFT counts (qvl.recipes.shapes.adapter_counts): what trains in a PEFT run is exactly the adapters
Megatron-Bridge's transform adds to the built model, for every family and target, LoRA and DoRA; and only they hold
gradients and optimizer state in the plan."""

from __future__ import annotations

import pytest

from qvl.foundation import distributed
from qvl.recipes.planner import plan_config
from qvl.recipes.registry import all_recipes, get_recipe

CASES = [
    ("qwen2_vl", "lora", "language,vision,merger"),
    ("qwen2_5_vl", "lora", "language,vision,merger"),
    ("qwen2_5_vl", "dora", "language"),
    ("qwen3_vl", "lora", "language,vision,merger"),
    ("qwen3_vl_moe", "lora", "language,vision,merger,experts"),
    ("qwen3_5_vl", "dora", "language,vision,merger"),
    ("qwen3_5_vl_moe", "lora", "language,vision,merger,experts"),
]


def _peft_recipe(family: str) -> str:
    return next(r.name for r in all_recipes() if r.family == family and r.stage == "peft")


def test_planned_trainable_parameters_equal_the_adapters_of_built_models(cpu_runtime, tiny_hf_dirs):
    import torch

    distributed.init_distributed()
    try:
        for family, method, targets in CASES:
            options = dict(precision="fp32", tensor_parallel=1, expert_parallel=1, adapter=method)
            cfg = get_recipe(_peft_recipe(family)).fn(
                hf_path=str(tiny_hf_dirs[family]), adapter_targets=targets, adapter_rank=8, **options
            )
            planned = plan_config(cfg, gpus=1).params_trainable
            cfg.model.finalize()
            chunks = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
            chunks = cfg.peft(chunks, training=True)
            trained = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
            assert planned == trained, (family, method, targets)
    finally:
        distributed.destroy_distributed()
        torch.manual_seed(0)


def test_frozen_weights_hold_no_gradients_or_optimizer_state_in_the_plan():
    full, peft = (
        plan_config(get_recipe("qwen3_vl_8b_sft").fn(), gpus=1),
        plan_config(get_recipe("qwen3_vl_8b_peft").fn(), gpus=1),
    )
    assert peft.params_total == full.params_total
    assert peft.params_trainable < full.params_total // 50
    stage = peft.stages[0]
    assert stage.grads < full.stages[0].grads / 50 and stage.optimizer < full.stages[0].optimizer / 50
    wider = plan_config(get_recipe("qwen3_vl_8b_peft").fn(adapter_targets="language,vision,merger"), gpus=1)
    assert wider.params_trainable > peft.params_trainable  # vision and merger adapters counted


@pytest.mark.parametrize("name", [r.name for r in all_recipes() if r.stage == "peft"])
def test_every_peft_recipe_plans(name):
    plan = plan_config(get_recipe(name).fn(), gpus=get_recipe(name).gpus or 8)
    assert 0 < plan.params_trainable < plan.params_total
