"""The planner against Megatron-Core's own accounting (tiny models on CPU), Megatron-LM's formulas and
published configurations."""

from __future__ import annotations

import json

import pytest
import torch

from qvl.foundation import distributed
from qvl.foundation.cost import lm_flops, vision_flops
from qvl.recipes import activations, planner, shapes
from qvl.recipes.overrides import apply_config_overrides, parse_overrides
from qvl.recipes.planner import GIB, plan_config, plan_recipe
from qvl.recipes.registry import get_recipe
from qvl.recipes.split import Workload


def test_parameter_counts_equal_megatron_models_built_on_cpu(cpu_runtime, tiny_hf_dirs):
    import torch

    distributed.init_distributed()
    try:
        for family, name in [
            ("qwen2_vl", "qwen2_vl_2b_sft"),
            ("qwen2_5_vl", "qwen2_5_vl_3b_sft"),
            ("qwen3_vl", "qwen3_vl_2b_sft"),
            ("qwen3_vl_moe", "qwen3_vl_30b_a3b_sft"),
            ("qwen3_5_vl", "qwen3_5_vl_9b_sft"),  # hybrid: Gated DeltaNet + gated attention layers
            ("qwen3_5_vl_moe", "qwen3_5_vl_35b_a3b_sft"),  # + a gated shared expert
        ]:
            cfg = get_recipe(name).fn(
                hf_path=str(tiny_hf_dirs[family]), precision="fp32", tensor_parallel=1, expert_parallel=1
            )
            cfg.model.finalize()
            chunks = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
            built = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            counted = sum(shapes.lm_param_counts(cfg.model).values()) + shapes.vision_param_count(cfg.model)
            assert counted == built, family
    finally:
        distributed.destroy_distributed()
        torch.manual_seed(0)


def test_published_sizes_count_like_the_released_checkpoints():
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn()
    # The released checkpoint's 8,292,166,656 plus the zero padding the model is built with (qvl.kernels.speed_aligned_widths):
    # 36 more gate and up rows (with biases) and down columns in each of the 32 vision blocks.
    padding = 32 * (2 * 36 * (1280 + 1) + 1280 * 36)
    assert plan_config(cfg, gpus=8).params_total == 8_292_166_656 + padding


def test_weight_and_optimizer_bytes_follow_megatron_lm_formula():
    # megatron/training/theoretical_memory_usage.py: 6 + 12/DP bytes per parameter with the distributed optimizer
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn()
    one, four = plan_config(cfg, gpus=2), plan_config(cfg, gpus=8)
    p1, p4 = one.stages[0], four.stages[0]
    params_per_gpu = p1.params / 2
    assert p1.grads == pytest.approx(4 * params_per_gpu) and p1.optimizer == pytest.approx(12 * params_per_gpu)
    assert p4.optimizer == pytest.approx(p1.optimizer / 4) and p4.params == p1.params
    offload = plan_config(get_recipe("qwen2_5_vl_7b_sft").fn(optimizer_offload=0.6), gpus=8).stages[0]
    assert offload.optimizer == pytest.approx(0.4 * p4.optimizer)


def test_frozen_and_lora_parameters_carry_no_optimizer_state():
    frozen = plan_config(get_recipe("qwen2_5_vl_7b_sft").fn(freeze="language,vision,projector"), gpus=8)
    assert frozen.stages[0].optimizer == 0 and frozen.params_trainable == 0
    lora = plan_config(get_recipe("qwen2_5_vl_7b_peft").fn(), gpus=1)
    assert 0 < lora.params_trainable < 0.01 * lora.params_total
    assert lora.stages[0].optimizer < 0.1 * lora.stages[0].params  # rank-32 adapters: ~0.9% of the weights


def test_activations_shrink_with_recompute_sequence_and_context_parallel():
    def acts(**kw):
        return plan_config(get_recipe("qwen3_vl_8b_sft").fn(**kw), gpus=8).stages[0].activations

    none, full = acts(), acts(recompute="full")
    selective = acts(recompute="selective", recompute_modules="core_attn,mlp")
    assert none > selective > full
    assert acts(sequence_parallel=False) > none
    assert acts(context_parallel=2) == pytest.approx(none / 2, rel=0.05)
    longer = plan_config(get_recipe("qwen3_vl_8b_sft").fn(seq_length=8192), gpus=8).stages[0].activations
    assert longer == pytest.approx(2 * none, rel=0.05)


def test_published_config_qwen2_5_vl_7b_sft_tp2_fits_80gb():
    plan = plan_recipe("qwen2_5_vl_7b_sft", {}, gpus=8, gpu="h100")
    assert plan.fits and plan.layout["tensor_parallel"] == 2 and plan.worst.total < 80 * GIB
    assert 0.2 < plan.mfu < 0.7


def test_a_config_that_does_not_fit_is_refused_with_changes_that_fit():
    plan = plan_recipe("qwen2_5_vl_7b_sft", {}, gpus=2, gpu="h100")
    assert not plan.fits and "does not fit" in plan.problems[0]
    assert any("offload" in s for s in plan.suggestions)
    for suggestion in plan.suggestions:  # each suggestion is itself a plan that fits
        assert float(suggestion.rsplit("(", 1)[1].split()[0]) < planner.GPUS["h100"].memory_gib


def test_suggestions_keep_the_users_dotted_fields():
    # A dotted field (here a longer sequence) is part of what must fit: each suggestion is re-planned with it.
    # Without it, 40% optimizer offload is enough (78.7 GiB); with it, that needs 83.9 GiB.
    assert plan_recipe("qwen2_5_vl_7b_sft", {}, gpus=2, gpu="h100").suggestions[0].startswith("optimizer_offload=0.4")
    dotted = {"model.seq_length": 5120}
    plan = plan_recipe("qwen2_5_vl_7b_sft", dotted, gpus=2, gpu="h100")
    assert not plan.fits and plan.suggestions
    assert not any(s.startswith("optimizer_offload=0.4") for s in plan.suggestions)
    info = get_recipe("qwen2_5_vl_7b_sft")
    for suggestion in plan.suggestions:
        label, gib = suggestion.rsplit(" (", 1)
        change = parse_overrides(label.split(" (")[0].split()).options
        cfg = apply_config_overrides(info.fn(**change), dict(dotted))
        assert f"{plan_config(cfg, gpus=2).worst.total / planner.GIB:.1f} GiB)" == gib


def test_layouts_that_do_not_divide_are_refused_naming_the_values():
    plan = plan_recipe("qwen2_5_vl_7b_sft", {"tensor_parallel": 4}, gpus=6, suggest=False)
    assert "--gpus 6" in plan.problems[0] and "4, 8" in plan.problems[0]
    plan = plan_recipe("qwen2_5_vl_7b_sft", {"global_batch_size": 90}, gpus=8, suggest=False)
    assert "global_batch_size=90" in plan.problems[0] and "global_batch_size=88" in plan.problems[0]
    plan = plan_recipe("qwen2_5_vl_7b_sft", {"precision": "fp8-delayed"}, gpus=8, gpu="a100", suggest=False)
    assert any("FP8" in p for p in plan.problems)


def test_flops_are_the_cost_models_times_three():
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn()
    workload = Workload(seq_length=4096, sample_tokens=1024, vision_token_fraction=0.5, patches_per_image=1024)
    plan = plan_config(cfg, gpus=8, workload=workload)
    lm, vision = shapes.model_shapes(cfg.model)
    per_pack = lm_flops(lm, [1024] * 4) + vision_flops(vision, [1024] * 8)
    assert plan.model_flops_per_step == pytest.approx(3 * per_pack * cfg.train.global_batch_size)


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_every_default_layout_fits_its_planned_gpus():
    from qvl.recipes.registry import all_recipes

    for info in all_recipes():
        plan = plan_recipe(info.name, {}, gpus=info.gpus, suggest=False)
        assert plan.fits, (info.name, plan.problems)


def test_pipeline_split_puts_less_lm_work_on_the_vision_stage():
    plan = plan_recipe("qwen2_5_vl_72b_sft", {}, gpus=64)
    layers = [s.layers for s in plan.stages]
    assert layers[0] < max(layers) and sum(layers) == 80
    flops = plan.stage_flops
    assert max(flops) / (sum(flops) / len(flops)) < 1.05


def test_vision_balance_cuts_the_vision_share_and_the_tower_activations_by_tp():
    def plan(**kw):
        return plan_config(get_recipe("qwen2_5_vl_7b_sft").fn(tensor_parallel=4, **kw), gpus=8)

    replicated, balanced = plan(), plan(vision_balance=True)
    share = balanced.vision_share
    assert share == replicated.vision_share and balanced.vision_balance and not replicated.vision_balance
    # Replicated, each TP rank encodes every image of its replica; balanced, a quarter of them (the LM's per-rank
    # FLOPs are 1/4 either way): vision / lm drops 4x.
    odds = [share[k] / (1 - share[k]) for k in ("replicated", "vision_balance")]
    assert odds[0] == pytest.approx(4 * odds[1])
    # The tower's activations shrink to a quarter; the moved pixels and embeddings cost less than that saves.
    saved = replicated.stages[0].activations - balanced.stages[0].activations
    tower = activations.vision_activation_bytes(get_recipe("qwen2_5_vl_7b_sft").fn().model, *_vision_and_patches())
    assert 0 < saved < 0.75 * tower
    assert "vision_balance" not in plan_config(get_recipe("qwen3_vl_8b_sft").fn(), gpus=8).vision_share


def _vision_and_patches():
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn(tensor_parallel=4)
    _, vision = shapes.model_shapes(cfg.model)
    workload = Workload(seq_length=cfg.model.seq_length)
    return vision, sum(workload.images(vision.spatial_merge_size)) * cfg.train.micro_batch_size


def _saved_bytes(tower, grid: list[list[int]], **kwargs) -> tuple[int, int]:
    """Bytes of the unique storages a forward saves for backward (parameters aside), and the patch count."""
    grid_thw = torch.tensor(grid)
    patches = int(grid_thw.prod(-1).sum())
    config = tower.config
    pixels = torch.randn(patches, 3 * config.temporal_patch_size * config.patch_size**2, dtype=torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in tower.parameters()}  # saved as views by the linear layers
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        tower(pixels, grid_thw=grid_thw, **kwargs)
    return sum(storages.values()), patches


class FlashSaves(torch.autograd.Function):
    """What torch's varlen flash kernel keeps for backward (torch/nn/attention/varlen.py `_setup_context`): q, k, v,
    the output and the fp32 log-sum-exp per head and token (and the small cu_seqlens and RNG state)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros_like(q)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[1], q.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("a forward-only stand-in")


def _measured_per_patch(family: str, size: str, *, compiled_regions: bool, monkeypatch) -> tuple[float, float]:
    """(bytes per patch per block, bytes per patch outside the blocks) of the family's published bf16 tower:
    towers of 2 and 3 blocks, the difference per block. `compiled_regions`: as a CUDA run trains it, speed-hf-vision's
    regions compiled by Inductor (for this CPU: the same partition of what is saved) and flash's saved tensors."""
    import importlib

    from qvl.foundation import patches
    from qvl.foundation.families import get_family
    from qvl.kernels import compiled, speed_hf_vision, varlen_attention
    from qvl.kernels.tower_inputs import tower_inputs_for_config
    from qvl.recipes.architectures import get_architecture, hf_config

    record = get_family(family)
    module = importlib.import_module(f"transformers.models.{record.hf_module}.modeling_{record.hf_module}")
    config = hf_config(get_architecture(family, size))
    grid = [[1, 16, 24], [1, 20, 20]]
    if compiled_regions:
        monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: not torch.compiler.is_compiling())
        monkeypatch.setattr(varlen_attention, "varlen_usable", lambda query, **kw: True)
        monkeypatch.setattr(varlen_attention, "varlen_attention", lambda q, k, v, *a, **kw: FlashSaves.apply(q, k, v))
    measured = []
    for depth in (2, 3):
        config.vision_config.depth = depth
        if hasattr(config.vision_config, "fullatt_block_indexes"):
            config.vision_config.fullatt_block_indexes = [depth - 1]
        torch.manual_seed(0)
        tower = getattr(module, record.vision_tower_class)._from_config(config.vision_config).to(torch.bfloat16)
        varlen_attention.varlen_vision_towers([tower])  # the attention training uses
        if not compiled_regions:
            measured.append(_saved_bytes(tower, grid))
            continue
        kwargs = speed_hf_vision.tower_kwargs(tower_inputs_for_config(torch.tensor(grid), config.vision_config))
        with patches.applied(speed_hf_vision.GROUP):
            measured.append(_saved_bytes(tower, grid, **kwargs))
    (two, patches_), (three, _) = measured
    return (three - two) / patches_, (two - 2 * (three - two)) / patches_


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_hf_vision_tower_bytes_match_what_the_published_qwen2_5_vl_tower_saves(monkeypatch):
    """The planner's per-patch bytes for the replicated HF tower against a measurement of the published Qwen2.5-VL
    ViT (1280 wide, SwiGLU 3420) in bf16, transformers' eager tower."""
    from qvl.foundation.cost import shapes_from_hf_config
    from qvl.recipes.architectures import get_architecture, hf_config

    per_block, outside = _measured_per_patch("qwen2_5_vl", "3b", compiled_regions=False, monkeypatch=monkeypatch)
    vision = shapes_from_hf_config(hf_config(get_architecture("qwen2_5_vl", "3b")).to_dict())[1]
    assert (per_block, outside) == pytest.approx(activations.hf_tower_bytes_per_patch(vision), rel=0.02)


@pytest.mark.slow  # ~30 s: Inductor compiles the regions for this CPU
@pytest.mark.parametrize("family, size", [("qwen2_5_vl", "3b"), ("qwen2_vl", "2b")])
def test_compiled_hf_vision_tower_bytes_match_what_the_tower_a_gpu_trains_saves(family, size, monkeypatch):
    """The same with speed-hf-vision's compiled regions and flash attention's saved tensors, as a CUDA run trains:
    a third less than the eager tower, which keeps fp32 copies in its norms and rotary."""
    from qvl.foundation.cost import shapes_from_hf_config
    from qvl.recipes.architectures import get_architecture, hf_config

    per_block, outside = _measured_per_patch(family, size, compiled_regions=True, monkeypatch=monkeypatch)
    vision = shapes_from_hf_config(hf_config(get_architecture(family, size)).to_dict())[1]
    expected = activations.hf_tower_bytes_per_patch(vision, compiled=True)
    assert (per_block, outside) == pytest.approx(expected, rel=0.01)
    assert expected[0] < 0.8 * activations.hf_tower_bytes_per_patch(vision)[0]


def test_the_plan_starts_from_the_prepared_datasets_workload(tiny_dataset):
    from qvl.recipes.split import workload_of_dataset

    report = json.loads((tiny_dataset / "report.json").read_text())
    assert report["media"] > 0 and report["vision_patches"] > 0  # counted while preparing
    cfg = get_recipe("qwen2_5_vl_7b_sft").fn(data=str(tiny_dataset))
    expected = workload_of_dataset(report, seq_length=cfg.model.seq_length, merge=2)
    assert expected.sample_tokens == round(report["total_tokens"] / report["accepted"])
    from_data = plan_config(cfg, gpus=8)
    assert from_data.worst.activations == plan_config(cfg, gpus=8, workload=expected).worst.activations
    # the sample set's small images are not the default mix (0.5 of tokens from 1024-patch images)
    assert from_data.worst.activations != plan_config(cfg, gpus=8, workload=Workload(seq_length=1)).worst.activations


def test_the_loss_keeps_what_the_cross_entropy_in_use_keeps():
    """qvl's fused cross-entropy (no TE/Apex) keeps the logits in the weights' dtype for backward; Megatron-Core's
    (unfused, or fused where TE or Apex is installed) an fp32 softmax: 2 bytes more per logit on the last stage.
    The target GPU's packages decide, not this machine's."""
    import dataclasses

    from qvl.kernels.switch import Target

    cfg = get_recipe("qwen2_5_vl_3b_sft").fn(tensor_parallel=1, pipeline_parallel=2)

    def last_stage(fusion: bool, **packages: bool) -> float:
        cfg.model.cross_entropy_loss_fusion = fusion
        target = dataclasses.replace(Target.of(cfg, device="cuda"), **packages)
        return plan_config(cfg, gpus=2, target=target).stages[-1].activations

    # one micro-batch in flight on the last stage; the loss at its text tokens only (qvl.loss_rows_only), half of
    # them in the default workload
    logits = cfg.model.seq_length * shapes.padded_vocab(cfg.model) * 0.5
    lean, fp32 = last_stage(fusion=True), last_stage(fusion=False)
    assert fp32 - lean == pytest.approx(2 * logits)
    assert last_stage(fusion=True, transformer_engine=True) == fp32  # TE on the target GPU: Megatron-Core's own
    assert last_stage(fusion=True, apex=True) == fp32
    assert plan_config(cfg, gpus=2).stages[-1].activations == lean  # by default: this environment's packages


def test_the_loss_rows_keep_the_logits_of_the_text_tokens_only():
    """With `qvl.loss_rows_only` (the default) the last stage keeps the logits of the workload's text tokens only;
    off, of every token."""
    cfg = get_recipe("qwen2_5_vl_3b_sft").fn(tensor_parallel=1, pipeline_parallel=2)
    workload = Workload(seq_length=cfg.model.seq_length, vision_token_fraction=0.75)
    rows = plan_config(cfg, gpus=2, workload=workload).stages[-1].activations
    cfg.qvl.loss_rows_only = False
    every = plan_config(cfg, gpus=2, workload=workload).stages[-1].activations
    logits = cfg.model.seq_length * shapes.padded_vocab(cfg.model) * 2  # qvl's cross-entropy keeps bf16 logits
    assert every - rows == pytest.approx(0.75 * logits)


def test_a_graphed_tower_with_sizes_planned_from_the_dataset_counts_the_rows_they_add(tmp_path):
    """With the dataset's packs (packs.jsonl `vision_rows`) the graphs pad each call to a size planned for them
    (qvl.kernels.tower_buckets): the plan counts the rows those sizes add, not the grid's worst case."""
    import json

    from qvl.kernels.switch import Target
    from qvl.kernels.tower_buckets import BUCKETS_PER_DOUBLING
    from qvl.recipes.plan_inputs import tower_rows_per_patch

    cfg = get_recipe("qwen2_5_vl_3b_pretrain").fn(data=str(tmp_path))
    cfg.qvl.cuda_graphs = True
    target = Target.of(cfg, device="cuda")
    assert tower_rows_per_patch(cfg, target) == 1 + 1 / BUCKETS_PER_DOUBLING  # no packs.jsonl: the grid's bound
    packs = [{"lengths": [9], "vision_rows": [rows, 0]} for rows in (1_000, 1_000, 3_000)]
    (tmp_path / "packs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in packs))
    # whole 112-pixel windows of 14-pixel patches: 64 rows; the sizes 1,024 and 3,008 add 24 + 24 + 8 rows
    assert tower_rows_per_patch(cfg, target) == pytest.approx(1 + 56 / 5_000)
    cfg.qvl.cuda_graphs = False
    assert tower_rows_per_patch(cfg, Target.of(cfg, device="cuda")) == 1.0


@pytest.mark.parametrize("layout", ["graphed", "pipeline_parallel=2", "ddp.overlap_grad_reduce", "vision_balance"])
def test_a_graphed_vision_tower_keeps_its_buckets_pad_rows(layout):
    """With speed-cuda-graphs the HF tower runs each call padded up to its bucket (at most 1/8 more rows,
    qvl.kernels.tower_graphs): the plan counts the tower's activations at those rows where the run graphs the tower,
    and not where it stays eager (the layers of two pipeline stages, DDP's overlapped reduction, balanced vision)."""
    from qvl.kernels.tower_buckets import BUCKETS_PER_DOUBLING
    from qvl.recipes.plan_inputs import plan_inputs

    def first_stage(graphs: bool) -> tuple[float, float]:
        cfg = get_recipe("qwen2_5_vl_3b_pretrain").fn(pipeline_parallel=2 if layout == "pipeline_parallel=2" else 1)
        cfg.ddp.overlap_grad_reduce = layout == "ddp.overlap_grad_reduce"
        cfg.qvl.vision_balance = layout == "vision_balance"
        cfg.qvl.cuda_graphs = graphs
        x = plan_inputs(cfg, gpus=8, gpu=planner.GPUS["h100"])
        patches = sum(x.workload.images(x.vision.spatial_merge_size)) * cfg.train.micro_batch_size
        tower = activations.vision_activation_bytes(
            cfg.model, x.vision, patches, compiled_tower=x.compiled_vision_tower
        )
        return plan_config(cfg, gpus=8).stages[0].activations, tower

    (graphed, tower), (eager, _) = first_stage(graphs=True), first_stage(graphs=False)
    assert tower > 0 and not get_recipe("qwen2_5_vl_3b_pretrain").fn().qvl.vision_recompute
    if layout == "graphed":
        assert graphed - eager == pytest.approx(tower / BUCKETS_PER_DOUBLING)
    else:
        assert graphed == eager


def test_grouped_experts_add_one_layers_stacked_expert_weights_to_the_activations():
    """grouped_experts=true (qvl.kernels.speed_grouped_experts): each stage's activations grow by its local experts'
    linear_fc1 weights stacked, their bf16 weight gradient and its fp32 copy (Qwen3-VL-30B-A3B at EP=8: 16 local
    experts of 2 x 768 x 2048, split over the SFT recipe's TP=2), one layer at a time; with adapters (the PEFT
    recipe: TP=1) the experts are frozen: the stack alone; a dense model is unchanged."""

    def fc1(plan) -> float:  # the local experts' linear_fc1 weights; each expert split over the TP ranks (ETP = TP)
        return 128 / plan.layout["expert_parallel"] * 2 * 768 * 2048 / plan.layout["tensor_parallel"]

    off = plan_recipe("qwen3_vl_30b_a3b_sft", {"expert_parallel": 8}, gpus=8)
    on = plan_recipe("qwen3_vl_30b_a3b_sft", {"expert_parallel": 8, "grouped_experts": True}, gpus=8)
    assert on.layout == off.layout and off.layout["tensor_parallel"] == 2
    for before, after in zip(off.stages, on.stages, strict=True):
        assert after.activations - before.activations == pytest.approx(fc1(on) * (2 + 2 + 4))
    peft_off = plan_recipe("qwen3_vl_30b_a3b_peft", {"expert_parallel": 8}, gpus=8)
    peft_on = plan_recipe("qwen3_vl_30b_a3b_peft", {"expert_parallel": 8, "grouped_experts": True}, gpus=8)
    assert peft_on.stages[0].activations - peft_off.stages[0].activations == pytest.approx(fc1(peft_on) * 2)
    dense = plan_recipe("qwen2_5_vl_7b_sft", {"grouped_experts": True}, gpus=8)
    assert dense.stages[0].activations == plan_recipe("qwen2_5_vl_7b_sft", {}, gpus=8).stages[0].activations
