"""vLLM's view of a qvl adapter (qvl.bridges.adapter_vllm), per adapted module group, as its LoRA loader treats it;
the per-family export that vLLM serves exactly is tested on trained runs in tests/training/test_train_peft.py."""

from __future__ import annotations

import pytest

from qvl.bridges.adapter_vllm import group_of, groups_of_config, max_lora_rank

# Live transformers module names of every family's adapted linears (Qwen2/2.5-VL's HF tower, Qwen3-VL's DeepStack
# mergers, Qwen3.5's DeltaNet, the MoE families' fused experts and shared expert).
GROUP_OF = {
    "model.visual.blocks.0.attn.qkv": "vision attention qkv",
    "model.visual.blocks.0.attn.proj": "vision tower",
    "model.visual.blocks.0.mlp.gate_proj": "vision tower",
    "model.visual.blocks.0.mlp.fc1": "vision tower",
    "model.visual.blocks.0.mlp.linear_fc1": "vision tower",
    "model.visual.merger.mlp.0": "merger",
    "model.visual.merger.linear_fc2": "merger",
    "model.visual.deepstack_merger_list.0.linear_fc1": "merger",
    "model.language_model.layers.0.linear_attn.in_proj_qkv": "Gated DeltaNet",
    "model.language_model.layers.0.linear_attn.in_proj_b": "Gated DeltaNet",
    "model.language_model.layers.0.linear_attn.out_proj": "Gated DeltaNet",
    "model.language_model.layers.0.mlp.experts.gate_up_proj": "MoE experts",
    "model.language_model.layers.0.mlp.experts.down_proj": "MoE experts",
    "model.language_model.layers.3.self_attn.q_proj": "language attention",
    "model.language_model.layers.3.self_attn.o_proj": "language attention",
    "model.language_model.layers.0.mlp.down_proj": "language MLP",
    "model.language_model.layers.0.mlp.shared_expert.up_proj": "language MLP",
}
SERVED = {"language attention", "language MLP"}


@pytest.mark.parametrize("name", GROUP_OF)
def test_each_adapted_module_falls_in_the_group_vllm_treats_it_as(name):
    group = group_of(name)
    assert group.name == GROUP_OF[name]
    assert group.served == (group.name in SERVED)


def test_the_view_of_a_written_adapter_names_every_group_and_why():
    modules = [n for n in GROUP_OF if ".mlp.experts." not in n]
    config = {"target_modules": modules, "target_parameters": [], "r": 32, "use_dora": False}
    view = {g.group: g for g in groups_of_config(config)}
    assert set(view) == set(GROUP_OF.values()) - {"MoE experts"}
    assert view["language attention"].modules == 2 and view["language attention"].served
    assert "--enable-tower-connector-lora" in view["vision tower"].why and not view["merger"].served
    assert "even with --enable-tower-connector-lora" in view["vision attention qkv"].why
    assert "vllm-project/vllm#49354" in view["Gated DeltaNet"].why
    experts = groups_of_config(config | {"target_parameters": ["model.language_model.layers.0.mlp.experts.down_proj"]})
    assert [g.served for g in experts if g.group == "MoE experts"] == [False]


def test_dora_and_a_rank_over_vllms_largest_serve_nothing_and_say_why():
    language = {"target_modules": ["model.language_model.layers.0.self_attn.q_proj"], "target_parameters": None}
    (dora,) = groups_of_config(language | {"r": 8, "use_dora": True})
    assert not dora.served and "refuses DoRA" in dora.why
    (huge,) = groups_of_config(language | {"r": 600, "use_dora": False})
    assert not huge.served and "over vLLM's largest --max-lora-rank 512" in huge.why
    assert [max_lora_rank(r) for r in (1, 8, 9, 16, 32, 300, 512, 513)] == [1, 8, 16, 16, 32, 320, 512, None]
