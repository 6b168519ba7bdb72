"""Memory and FLOP planner: what a recipe's ConfigContainer needs per GPU, and whether it fits.

Memory per GPU (the most loaded pipeline stage decides):
- Weights, gradients, optimizer state: Megatron's accounting, as in Megatron-LM
  `megatron/training/theoretical_memory_usage.py` (`compute_weight_and_optimizer_memory`): with the
  distributed optimizer a trainable parameter costs 6 + 12/DP bytes (bf16 weight 2, fp32 main grad 4,
  fp32 master weight + Adam m + v = 12 sharded over the data-parallel group; experts over the
  expert-data-parallel group). Frozen parameters cost their weight only. `optimizer_offload` moves that
  fraction of the 12/DP to the CPU (Megatron-Core's HybridDeviceOptimizer).
- Activations: per token and layer, the tensors autograd keeps with flash attention (no s^2 term), the
  Korthikanti et al. 2022 (arXiv 2205.05198, Table 2) inventory redone for GQA and gated MLPs; LayerNorm
  inputs/outputs are split by TP only with sequence parallelism. 1F1B keeps min(PP - stage, micro-batches)
  micro-batches in flight (interleaving: x (1 + (PP-1)/(PP*VPP)), the same formula's penalty). Full
  recompute keeps each layer's input plus one layer's working set. The vision tower's activations sit on
  stage 0 (replicated over TP for the HF towers of Qwen2-VL / Qwen2.5-VL; with `vision_balance` each rank keeps
  those of its 1/TP share of the images, plus the moved pixels and embeddings, `vision_balance_buffer_bytes`).
FLOPs: `qvl.foundation.cost` (forward FLOPs; x3 for training, +1 forward for full recompute). MFU is an estimate
from a roofline: GEMM efficiency, pipeline bubble, unoverlapped TP/EP/DP communication.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qvl.foundation.errors import ConfigError
from qvl.foundation.layout import ParallelLayout
from qvl.recipes.activations import (
    layer_activation_bytes,
    vision_activation_bytes,
    vision_balance_buffer_bytes,
    vision_shares,
)
from qvl.recipes.overrides import Overrides, apply_config_overrides
from qvl.recipes.registry import get_recipe
from qvl.recipes.shapes import (
    lm_layer_params,
    lm_param_counts,
    lora_params_per_layer,
    model_shapes,
    padded_vocab,
    vision_is_megatron,
    vision_param_count,
)
from qvl.recipes.split import Workload, counts, split_from_counts, stage_costs, workload_of_dataset

GIB = 1024**3


@dataclass(kw_only=True, slots=True, frozen=True)
class GPU:
    """One accelerator kind: memory, dense peak FLOP/s and link bandwidths (bytes/s per GPU)."""

    name: str
    memory_gib: float
    bf16_flops: float
    fp8_flops: float | None
    intra_node_bw: float  # NVLink, one direction
    inter_node_bw: float  # InfiniBand NIC per GPU
    gpus_per_node: int = 8


GPUS = {
    "h100": GPU(
        name="H100 SXM 80GB",
        memory_gib=79.6,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "h200": GPU(
        name="H200 SXM 141GB",
        memory_gib=139.8,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "a100": GPU(
        name="A100 SXM 80GB",
        memory_gib=79.2,
        bf16_flops=312e12,
        fp8_flops=None,
        intra_node_bw=300e9,
        inter_node_bw=25e9,
    ),
}
OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation: what a real run adds on top
# Share of peak a Megatron step's compute reaches: large GEMMs ~0.7, less for norms, attention kernels, the ViT.
GEMM_EFFICIENCY = 0.5


@dataclass(kw_only=True, slots=True)
class StageMemory:
    """Bytes on one GPU of one pipeline stage."""

    layers: int
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    overhead: float = OVERHEAD_GIB * GIB

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    """A recipe's per-GPU memory, split, FLOPs and MFU estimate on `gpus` GPUs of one kind."""

    gpus: int
    gpu: GPU
    layout: dict[str, int]
    stages: list[StageMemory]
    stage_flops: list[float]  # forward FLOPs per micro-batch per stage
    params_total: int
    params_trainable: int
    model_flops_per_step: float
    step_time_s: float
    mfu: float
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    # Share of a stage-0 rank's forward FLOPs that is vision work: "replicated" (each TP rank encodes all of its
    # replica's images) and "vision_balance" (each image once over the DP x TP grid); which one runs: vision_balance.
    vision_share: dict[str, float] = field(default_factory=dict)
    vision_balance: bool = False

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return not self.problems


# --- memory --------------------------------------------------------------------------------------------------


def _bytes_per_param(cfg: Any) -> tuple[int, int, int]:
    """(weight, main grad, optimizer state) bytes per trainable parameter before sharding."""
    bf16 = cfg.mixed_precision is not None
    return (2, 4, 12) if bf16 else (4, 4, 8)  # fp32 runs have no separate master copy


def _stage_params(model: Any, cfg: Any, layers: list[int]) -> list[tuple[float, float, float, float]]:
    """Per stage: (frozen, trainable dense, trainable expert) params on one GPU, and total trainable."""
    tp, ep = model.tensor_model_parallel_size, model.expert_model_parallel_size
    etp = getattr(model, "expert_tensor_parallel_size", None) or tp
    parts = lm_param_counts(model)
    dense_layer, expert_layer = lm_layer_params(model)
    vision = vision_param_count(model)
    vision_shard = tp if vision_is_megatron(model) else 1
    peft = cfg.peft is not None
    lm_frozen = model.freeze_language_model or peft
    out = []
    for s, n in enumerate(layers):
        dense = n * dense_layer / tp + (parts["embedding"] / tp if s == 0 else 0)
        dense += (parts["output"] or (parts["embedding"] if len(layers) > 1 else 0)) / tp if s == len(layers) - 1 else 0
        expert = n * expert_layer / (ep * etp)
        frozen, train_dense, train_expert = (dense + expert, 0.0, 0.0) if lm_frozen else (0.0, dense, expert)
        if s == 0:
            vis = vision / vision_shard
            if peft or (model.freeze_vision_model and model.freeze_vision_projection):
                frozen += vis
            else:
                train_dense += vis  # a frozen tower with a trainable merger: the merger is small; counted trainable
        if peft:
            train_dense += n * lora_params_per_layer(model, cfg.peft.dim) / tp
        out.append((frozen, train_dense, train_expert, train_dense + train_expert))
    return out


def _in_flight(model: Any, stage: int, microbatches: int) -> float:
    pp, vpp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size
    n = min(pp - stage, microbatches)
    return n * (1 + (pp - 1) / (pp * vpp)) if vpp else n


def dataset_workload(cfg: Any) -> Workload | None:
    """The workload of the prepared dataset the config trains on (its report.json), if it names one."""
    path = getattr(cfg.dataset, "path", None)
    report = Path(path) / "report.json" if path else None
    if report is None or not report.is_file():
        return None
    _, vision = model_shapes(cfg.model)
    merge = vision.spatial_merge_size if vision is not None else 2
    return workload_of_dataset(json.loads(report.read_text()), seq_length=cfg.model.seq_length, merge=merge)


@dataclass(kw_only=True, slots=True)
class _Layout:
    """The parallel layout of a config on `gpus` GPUs, and the micro-batches each pipeline runs per step."""

    sizes: dict[str, int]
    data_parallel: int
    expert_data_parallel: int
    layers: list[int]  # LM layers per pipeline stage
    microbatches: int


def _layout(cfg: Any, gpus: int) -> _Layout:
    model = cfg.model
    tp, pp, cp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size
    ep = model.expert_model_parallel_size
    etp = getattr(model, "expert_tensor_parallel_size", None) or tp
    dp = max(gpus // (tp * pp * cp), 1)
    sizes = dict(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        expert_parallel=ep,
        virtual_pipeline=model.virtual_pipeline_model_parallel_size or 1,
        data_parallel=dp,
    )
    layers = counts(
        model.num_layers, pp, model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage
    )
    microbatches = max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp), 1)
    return _Layout(
        sizes=sizes,
        data_parallel=dp,
        expert_data_parallel=max(gpus // (etp * ep * pp), 1),
        layers=layers,
        microbatches=microbatches,
    )


def _loss_bytes_per_logit(model: Any, weight_bytes: int) -> int:
    """Bytes per logit the loss keeps for backward: Megatron-Core's cross-entropies keep an fp32 softmax; qvl's fused
    one (qvl.kernels.speed_cross_entropy, in its place where Transformer Engine and Apex are absent) keeps the logits."""
    from qvl.kernels import fix_adam_resume

    lean = getattr(model, "cross_entropy_loss_fusion", False) and fix_adam_resume.needed()
    return weight_bytes if lean else 4


def _stage_memory(cfg: Any, lay: _Layout, workload: Workload) -> list[StageMemory]:
    """Per pipeline stage: parameters, gradients, optimizer state and activations on one GPU."""
    model = cfg.model
    tp, pp, cp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size
    lm, vision = model_shapes(model)
    mbs = cfg.train.micro_batch_size
    weight_b, grad_b, optim_b = _bytes_per_param(cfg)
    offload = cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else 0.0
    recompute, modules = model.recompute_granularity, list(model.recompute_modules or [])
    tokens = workload.seq_length * mbs / cp
    patches = sum(workload.images(vision.spatial_merge_size)) * mbs / cp
    balanced = bool(getattr(getattr(cfg, "qvl", None), "vision_balance", False))
    vision_recompute = bool(getattr(getattr(cfg, "qvl", None), "vision_recompute", False))
    stages = []
    for s, (frozen, train_dense, train_expert, trainable) in enumerate(_stage_params(model, cfg, lay.layers)):
        mem = StageMemory(layers=lay.layers[s])
        mem.params = (frozen + trainable) * weight_b
        mem.grads = trainable * grad_b
        mem.optimizer = (train_dense / lay.data_parallel + train_expert / lay.expert_data_parallel) * optim_b
        mem.optimizer *= 1 - offload
        acts = layer_activation_bytes(model, lm, tokens, recompute=recompute, modules=modules) * lay.layers[s]
        if s == 0 and balanced:  # this rank keeps the activations of its 1/TP share of the images only
            acts += vision_activation_bytes(model, vision, patches / tp, recompute=vision_recompute)
            acts += tokens * 2 * lm.hidden_size
            acts += vision_balance_buffer_bytes(vision, patches, tp)
        elif s == 0:
            acts += vision_activation_bytes(model, vision, patches, recompute=vision_recompute)
            acts += tokens * 2 * lm.hidden_size
        if s == pp - 1:  # the final norm's output, fp32 (same source), and what the loss keeps per logit
            acts += tokens * (4 * lm.hidden_size + _loss_bytes_per_logit(model, weight_b) * padded_vocab(model)) / tp
        acts *= _in_flight(model, s, lay.microbatches)
        if recompute == "full":  # one layer rebuilt at a time for backward
            acts += layer_activation_bytes(model, lm, tokens, recompute=None, modules=[])
        mem.activations = acts
        stages.append(mem)
    return stages


def plan_config(cfg: Any, *, gpus: int, gpu: str = "h100", workload: Workload | None = None) -> MemoryPlan:
    """Memory per GPU, pipeline split, FLOPs and an MFU estimate for `cfg` on `gpus` GPUs of kind `gpu`."""
    if gpu not in GPUS:
        raise ConfigError(f"gpu={gpu!r} is not known; use one of: {', '.join(GPUS)}")
    hw, model = GPUS[gpu], cfg.model
    problems = _divisibility(cfg, gpus, hw)
    lay = _layout(cfg, gpus)
    workload = replace(workload or dataset_workload(cfg) or Workload(seq_length=1), seq_length=model.seq_length)
    stages = _stage_memory(cfg, lay, workload)
    usable = hw.memory_gib * GIB
    worst = max(range(len(stages)), key=lambda s: stages[s].total)
    if stages[worst].total > usable:
        problems.append(
            f"does not fit: pipeline stage {worst} needs {stages[worst].total / GIB:.1f} GiB per GPU, "
            f"the {hw.name} has {hw.memory_gib:.1f} GiB"
        )
    lm, vision = model_shapes(model)
    mbs = cfg.train.micro_batch_size
    costs = stage_costs(lm, vision, workload)
    fwd = [c * mbs for c in split_from_counts(lay.layers, costs).costs]
    total_params = sum(lm_param_counts(model).values()) + vision_param_count(model)
    trainable_total = _trainable_total(model, cfg, total_params)
    model_flops = 3 * sum(fwd) * cfg.train.global_batch_size / mbs
    step = _step_time(
        StepTimeInputs(
            cfg=cfg,
            gpu=hw,
            gpus=gpus,
            stage_flops=fwd,
            layout=lay,
            tokens=workload.seq_length * mbs / model.context_parallel_size,
            hidden_size=lm.hidden_size,
            moe_router_topk=(lm.moe_router_topk or 0) if lm.num_experts else 0,
            trainable_params=trainable_total,
        )
    )
    return MemoryPlan(
        gpus=gpus,
        gpu=hw,
        layout=lay.sizes,
        stages=stages,
        stage_flops=fwd,
        params_total=total_params,
        params_trainable=trainable_total,
        model_flops_per_step=model_flops,
        step_time_s=step,
        mfu=model_flops / (step * gpus * _peak_flops(cfg, hw)),
        problems=problems,
        vision_share=vision_shares(model, costs, lay.layers[0]),
        vision_balance=bool(getattr(getattr(cfg, "qvl", None), "vision_balance", False)),
    )


def _trainable_total(model: Any, cfg: Any, total: int) -> int:
    if cfg.peft is not None:
        return lora_params_per_layer(model, cfg.peft.dim) * model.num_layers
    frozen = sum(lm_param_counts(model).values()) if model.freeze_language_model else 0
    if model.freeze_vision_model and model.freeze_vision_projection:
        frozen += vision_param_count(model)
    return total - frozen


def _divisibility(cfg: Any, gpus: int, hw: GPU) -> list[str]:
    model, problems = cfg.model, []
    tp, pp, cp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size
    ep = model.expert_model_parallel_size
    etp = getattr(model, "expert_tensor_parallel_size", None) or tp
    layout = ParallelLayout(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=ep)
    if gpus % layout.ranks:
        fit = [g for g in range(layout.ranks, 4 * gpus + 1, layout.ranks)][:4]
        problems.append(
            f"--gpus {gpus} is not a multiple of {layout.describe()} = {layout.ranks}; "
            f"use --gpus {', '.join(map(str, fit))}"
        )
    elif gpus % (etp * ep * pp):
        problems.append(
            f"--gpus {gpus} is not a multiple of expert_parallel x expert tensor x pipeline = "
            f"{etp * ep * pp}; change expert_parallel or --gpus"
        )
    else:
        dp = gpus // (tp * pp * cp)
        mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
        if gbs % (mbs * dp):
            good = (gbs // (mbs * dp) or 1) * mbs * dp
            problems.append(
                f"global_batch_size={gbs} is not a multiple of micro_batch_size x data_parallel = "
                f"{mbs * dp}; use global_batch_size={good}"
            )
    if cfg.mixed_precision and "fp8" in str(cfg.mixed_precision) and hw.fp8_flops is None:
        problems.append(
            f"precision {cfg.mixed_precision} needs FP8 tensor cores; the {hw.name} has none: use precision=bf16-mixed"
        )
    return problems


@dataclass(kw_only=True, slots=True)
class StepTimeInputs:
    """What the roofline step-time model reads: the config, the GPU, the stages' FLOPs and the layout."""

    cfg: Any
    gpu: GPU
    gpus: int
    stage_flops: list[float]  # forward FLOPs per micro-batch per pipeline stage
    layout: _Layout
    tokens: float  # tokens per micro-batch per context-parallel rank
    hidden_size: int
    moe_router_topk: int  # 0 for a dense model
    trainable_params: int


def _peak_flops(cfg: Any, hw: GPU) -> float:
    fp8 = cfg.mixed_precision and "fp8" in str(cfg.mixed_precision) and hw.fp8_flops
    return hw.fp8_flops if fp8 else hw.bf16_flops


def _step_time(x: StepTimeInputs) -> float:
    """Roofline step time: bottleneck stage x (micro-batches + bubble), plus unoverlapped comms."""
    model, hw = x.cfg.model, x.gpu
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    recompute_factor = 4 / 3 if model.recompute_granularity == "full" else 1.0
    per_micro = max(x.stage_flops) * 3 * recompute_factor / (tp * model.context_parallel_size)
    per_micro /= _peak_flops(x.cfg, hw) * GEMM_EFFICIENCY
    deepest = max(x.layout.layers)

    def bw(group: int) -> float:
        return hw.intra_node_bw if group <= hw.gpus_per_node else hw.inter_node_bw

    # TP: 2 all-reduces (or all-gather + reduce-scatter) of the activations per layer, forward and backward.
    if tp > 1:
        per_micro += deepest * 4 * 2 * (tp - 1) / tp * x.tokens * x.hidden_size * 2 / bw(tp)
    if x.moe_router_topk and model.expert_model_parallel_size > 1:
        ep = model.expert_model_parallel_size
        local = x.tokens / (tp if model.sequence_parallel else 1)  # each TP rank dispatches its sequence shard
        per_micro += deepest * 4 * (ep - 1) / ep * local * x.moe_router_topk * x.hidden_size * 2 / bw(ep * tp)
    vpp = model.virtual_pipeline_model_parallel_size or 1
    step = per_micro * (x.layout.microbatches + (pp - 1) / vpp)
    dp = x.layout.data_parallel
    if dp > 1:  # reduce-scatter fp32 grads + all-gather bf16 params, not overlapped in VLM recipes
        step += (dp - 1) / dp * x.trainable_params / (tp * pp) * 6 / bw(x.gpus)
    return step


# --- recipes: plan, and say what would fit --------------------------------------------------------------------


def plan_recipe(
    name: str, overrides: dict, *, gpus: int, gpu: str = "h100", workload: Workload | None = None, suggest: bool = True
) -> MemoryPlan:
    """Plan the registered recipe `name` with `overrides`; when it does not fit, list overrides that do."""
    info = get_recipe(name)
    split = Overrides.of(overrides)
    overrides, dotted = split.options, split.config  # dotted fields (train.global_batch_size=...) set the built config
    plan = plan_config(apply_config_overrides(info.fn(**overrides), dotted), gpus=gpus, gpu=gpu, workload=workload)
    if suggest and plan.problems and all(p.startswith("does not fit") for p in plan.problems):
        plan.suggestions = _suggestions(info, overrides, dotted, plan, gpus=gpus, gpu=gpu, workload=workload)
    return plan


def _candidates(plan: MemoryPlan, overrides: dict) -> list[tuple[str, dict]]:
    tp, pp = plan.layout["tensor_parallel"], plan.layout["pipeline_parallel"]
    out = [
        # First: the cheapest (the HF vision tower's blocks rerun; a Megatron tower's plan does not change with it)
        ("vision_recompute=true", {"vision_recompute": True}),
        ("recompute=selective", {"recompute": "selective", "recompute_modules": "core_attn,mlp"}),
        ("recompute=full", {"recompute": "full"}),
    ]
    out += [
        (f"optimizer_offload={f:.1f} (offload {f:.0%} of optimizer state)", {"optimizer_offload": f})
        for f in (0.2, 0.4, 0.6, 0.8, 1.0)
    ]
    out += [(f"tensor_parallel={tp * k}", {"tensor_parallel": tp * k}) for k in (2, 4)]
    out += [(f"pipeline_parallel={pp * k}", {"pipeline_parallel": pp * k}) for k in (2, 4)]
    out += [("recompute=full optimizer_offload=0.5", {"recompute": "full", "optimizer_offload": 0.5})]
    return [(label, change) for label, change in out if any(overrides.get(k) != v for k, v in change.items())]


def _suggestions(info, overrides: dict, dotted: dict, plan: MemoryPlan, **kw) -> list[str]:
    """Changes that make the plan fit, each re-planned with the user's options and dotted fields kept."""
    found: list[str] = []
    offload_found = False
    for label, change in _candidates(plan, overrides):
        if offload_found and "optimizer_offload" in change and "recompute" not in change:
            continue  # the smallest offload that fits is enough
        try:
            trial = plan_config(apply_config_overrides(info.fn(**{**overrides, **change}), dotted), **kw)
        except ValueError:  # e.g. a TP that does not divide the heads
            continue
        if trial.fits:
            found.append(f"{label} ({trial.worst.total / GIB:.1f} GiB)")
            offload_found |= "optimizer_offload" in change
        if len(found) == 4:
            break
    return found
