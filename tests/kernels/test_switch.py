"""The one switch (qvl.kernels.switch): every group of the registry has one rule, the answers are the target's (not
this machine's), they agree with what the code that applies a group checks at run time, and the training loop
applies what it decides and undoes it after."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from qvl.foundation import patch_entries, patches
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import get_family
from qvl.kernels import switch
from qvl.kernels.switch import Target


def test_every_group_has_one_rule_with_a_known_kind_and_scope():
    groups = [rule.group for rule in switch.RULES]
    assert len(groups) == len(set(groups))
    missing = [g for g in patches.GROUPS if g not in groups]
    assert not missing, f"groups without a rule in qvl.kernels.switch.RULES (say when each is on): {missing}"
    assert all(rule.scope in switch.SCOPES for rule in switch.RULES)
    assert all(patch_entries.kind_of(group) in patch_entries.KINDS for group in patches.GROUPS)
    assert [d.group for d in switch.decide(Target(device="cpu"))] == list(patches.GROUPS)


def test_a_rule_whose_group_left_the_registry_is_dropped(monkeypatch):
    monkeypatch.setattr(patches, "GROUPS", tuple(g for g in patches.GROUPS if g != "speed-rotary"))
    target = Target(device="cuda")
    assert "speed-rotary" not in [d.group for d in switch.decide(target)]
    assert not switch.is_on("speed-rotary", target) and "speed-rotary" not in switch.training_groups(target)


def test_the_answer_is_the_targets_not_this_machines():
    bare_gpu = Target(device="cuda", hf_vision_tower=True, gated_delta_net=False, mtp=False, peft=False,
                      cuda_graphs=True, async_save=False)  # fmt: skip
    assert switch.training_groups(bare_gpu) == (
        "fix-megatron-setup", "fix-adam-resume", "speed-optimizer", "speed-small-grads", "speed-rotary",
        "speed-sync-free", "speed-jit-warmup", "speed-sync-save", "speed-cross-entropy", "speed-cuda-graphs", "torch-wgrad-accum",
        "speed-hf-vision",
    )  # fmt: skip
    with_te = dataclasses.replace(bare_gpu, transformer_engine=True)
    assert not switch.is_on("speed-cross-entropy", with_te) and not switch.is_on("fix-adam-resume", with_te)
    assert switch.is_on("torch-wgrad-accum", with_te)  # TE does not bring Apex's wgrad kernels
    assert not switch.is_on("torch-wgrad-accum", dataclasses.replace(bare_gpu, apex=True))
    cpu = dataclasses.replace(bare_gpu, device="cpu")
    assert switch.training_groups(cpu)[0] == "cpu-training" and switch.is_on("cpu-runtime", cpu)
    assert not switch.is_on("cpu-runtime", bare_gpu)
    # CUDA graphs: asked for, and only where qvl's layers read nothing back (no TE, no Apex); on the CPU recorded
    assert switch.is_on("speed-cuda-graphs", bare_gpu) and not switch.is_on("cpu-cuda-graphs", bare_gpu)
    assert switch.is_on("speed-cuda-graphs", cpu) and switch.is_on("cpu-cuda-graphs", cpu)
    assert not switch.is_on("cpu-cuda-graphs", dataclasses.replace(cpu, cuda_graphs=False))
    assert not switch.is_on("speed-cuda-graphs", dataclasses.replace(bare_gpu, cuda_graphs=False))
    assert not switch.is_on("speed-cuda-graphs", with_te)
    assert not switch.is_on("speed-cuda-graphs", dataclasses.replace(bare_gpu, apex=True))
    qwen35 = dataclasses.replace(bare_gpu, hf_vision_tower=False, gated_delta_net=True)
    assert switch.is_on("torch-gated-delta", qwen35) and switch.is_on("torch-qwen3-vl-vision", qwen35)
    assert not switch.is_on("torch-gated-delta", dataclasses.replace(qwen35, fla=True))  # fla's Triton kernels
    assert switch.is_on("torch-gated-delta", dataclasses.replace(qwen35, fla=True, device="cpu"))  # fla needs CUDA
    # MoE: the identity sort skipped always; grouped experts asked for, and without TE (TE groups its own)
    moe = dataclasses.replace(bare_gpu, moe=True)
    assert switch.is_on("speed-moe-one-rank-dispatch", moe)
    assert not switch.is_on("speed-moe-one-rank-dispatch", bare_gpu)
    assert not switch.is_on("speed-grouped-experts", moe)
    grouped = dataclasses.replace(moe, grouped_experts=True)
    assert switch.is_on("speed-grouped-experts", grouped)
    assert switch.is_on("speed-grouped-experts", dataclasses.replace(grouped, device="cpu"))
    assert not switch.is_on("speed-grouped-experts", dataclasses.replace(grouped, transformer_engine=True))
    assert not switch.is_on("speed-grouped-experts", dataclasses.replace(bare_gpu, grouped_experts=True))  # dense


def test_without_a_model_the_model_groups_are_left_open():
    decisions = {d.group: d for d in switch.decide(Target(device="cuda"))}
    assert decisions["speed-hf-vision"].on is None and decisions["torch-gated-delta"].on is None
    assert decisions["fix-adam-resume"].on is True and decisions["cpu-runtime"].on is False
    assert decisions["fix-adam-resume"].reason.startswith("on on cuda: neither Transformer Engine nor Apex")
    assert "speed-hf-vision" not in switch.training_groups(Target(device="cuda"))


def test_an_unknown_device_is_refused():
    with pytest.raises(ConfigError, match="device='tpu' is not a run's device; use one of: cpu, cuda"):
        Target(device="tpu")


def test_here_the_switch_agrees_with_what_the_applying_code_checks(cpu_runtime):
    """On this machine the rules give the answers the code that applies each group computes at run time."""
    from megatron.core.optimizer import distrib_optimizer

    from qvl.foundation.megatron import have_transformer_engine
    from qvl.kernels.torch_gated_delta import fla_usable

    here = Target.of(device=switch.current_device())
    assert here.device == "cpu"  # the CPU runtime is active
    assert here.torch_stack == (not distrib_optimizer.HAVE_APEX_OR_TE)
    model = dataclasses.replace(here, hf_vision_tower=False, gated_delta_net=True, mtp=True, peft=True)
    assert switch.is_on("torch-gated-delta", model) == (not fla_usable())
    assert switch.is_on("torch-qwen3-vl-vision", model) == (not have_transformer_engine())
    assert switch.is_on("fix-peft-without-te", model) == (not have_transformer_engine())


def _config(family: str, **model_fields) -> SimpleNamespace:
    """A ConfigContainer's shape: a provider whose HF vision config has the family record's class name."""
    vision = type(get_family(family).vision_config_class, (), {})()
    return SimpleNamespace(model=SimpleNamespace(vision_config=vision, **model_fields), peft=None)


def test_targets_read_the_model_parts_from_the_config():
    qwen25 = Target.of(_config("qwen2_5_vl"), device="cuda")
    assert (qwen25.hf_vision_tower, qwen25.gated_delta_net, qwen25.mtp, qwen25.peft) == (True, False, False, False)
    qwen35 = _config("qwen3_5_vl", experimental_attention_variant="gated_delta_net", mtp_num_layers=1)
    qwen35.peft = SimpleNamespace(dim=8)
    target = Target.of(qwen35, device="cpu")
    assert (target.hf_vision_tower, target.gated_delta_net, target.mtp, target.peft) == (False, True, True, True)
    assert switch.is_on("torch-gated-delta", target) and switch.is_on("fix-mtp-loss", target)
    assert not switch.is_on("speed-hf-vision", target)


@pytest.mark.parametrize(
    ("experts", "stages", "tp", "sp", "graphs", "on"),
    [(4, 2, 1, False, False, True), (4, 1, 2, True, False, True), (4, 1, 2, False, False, False),
     (4, 1, 1, False, False, False), (4, 1, 1, False, True, True), (None, 2, 2, True, True, False)],
)  # fmt: skip
def test_only_an_moe_model_whose_packs_are_padded_masks_the_pad_in_its_routers(experts, stages, tp, sp, graphs, on):
    """Pipeline stages, sequence parallelism and CUDA graphs (every pack padded to seq_length) pad the packs."""
    config = _config("qwen3_vl_moe", num_moe_experts=experts, pipeline_model_parallel_size=stages,
                     tensor_model_parallel_size=tp, sequence_parallel=sp)  # fmt: skip
    config.qvl = SimpleNamespace(cuda_graphs=graphs)
    target = Target.of(config, device="cuda")
    assert target.padded_moe is on
    assert ("fix-moe-pad-tokens" in switch.training_groups(target)) is on


def test_applied_for_training_undoes_what_it_applied_and_keeps_what_was_there():
    from qvl.foundation import megatron

    megatron.import_megatron_bridge()  # some targets live in modules that need its stand-ins
    target = Target(device="cuda", hf_vision_tower=False)
    before = {g for g in patches.GROUPS if patches.is_applied(g)}  # what earlier tests left on, process-wide
    was_rotary = "speed-rotary" in before
    patches.apply("speed-rotary")  # as a model built earlier in the process would have
    try:
        with switch.applied_for_training(target):
            assert all(patches.is_applied(g) for g in switch.training_groups(target))
        after = {g for g in patches.GROUPS if patches.is_applied(g)}
        assert after == before | {"speed-rotary"}
        assert set(switch.training_groups(target)) - before - {"speed-rotary"}  # the check had groups to undo
    finally:
        if not was_rotary:
            patches.undo("speed-rotary")


def test_the_training_loop_runs_under_the_groups_the_switch_decides(monkeypatch):
    from qvl.foundation import megatron

    megatron.import_megatron_bridge()
    from megatron.bridge.training import pretrain as pretrain_module

    from qvl.training.loop import run_megatron_loop

    seen = []
    monkeypatch.setattr(pretrain_module, "pretrain", lambda config, step, callbacks: seen.append(set(patches._APPLIED)))
    config = SimpleNamespace(model=SimpleNamespace(), peft=None)  # no vision tower, no adapters
    before = set(patches._APPLIED)
    run_megatron_loop(config, forward_step=None, callbacks=None)
    assert seen == [before | set(switch.training_groups(Target.of(config)))]
    assert set(patches._APPLIED) == before
