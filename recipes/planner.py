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
  those of its 1/TP share of the images, plus the moved pixels and embeddings, `vision_balance_buffer_bytes`). The
  last stage keeps the logits the loss needs for backward: of the workload's text tokens only where the output layer
  runs at the loss-bearing positions (`qvl.loss_rows_only`, qvl.kernels.loss_rows), else of every token.
FLOPs: `qvl.foundation.cost` (forward FLOPs; x3 for training, +1 forward for full recompute). MFU is an estimate
from a roofline: GEMM efficiency, pipeline bubble, unoverlapped TP/EP/DP communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from qvl.foundation.cost import LMShape, VisionShape, lm_flops
from qvl.foundation.errors import ConfigError
from qvl.kernels.switch import Target
from qvl.recipes.activations import (
    layer_activation_bytes,
    vision_activation_bytes,
    vision_balance_buffer_bytes,
    vision_shares,
)
from qvl.recipes.overrides import Overrides, apply_config_overrides
from qvl.recipes.plan_inputs import GPU, GPUS, PlanInputs, plan_inputs
from qvl.recipes.registry import get_recipe
from qvl.recipes.shapes import (
    adapter_counts,
    lm_layer_params,
    lm_param_counts,
    mtp_layer_params,
    mtp_layers,
    padded_vocab,
    vision_is_megatron,
    vision_param_count,
)
from qvl.recipes.split import Workload, split_from_counts, stage_costs

GIB = 1024**3
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
    mtp_share: float = 0.0  # share of a step's forward FLOPs in the multi-token-prediction layers (0 without MTP)

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


@dataclass(kw_only=True, slots=True, frozen=True)
class StageParams:
    """Parameters of one pipeline stage on one GPU: frozen, trainable dense and trainable expert."""

    frozen: float
    trainable_dense: float
    trainable_expert: float

    @property
    def trainable(self) -> float:
        return self.trainable_dense + self.trainable_expert


def _stage_params(x: PlanInputs) -> list[StageParams]:
    """Per pipeline stage: the parameters one GPU holds."""
    model, cfg, layout = x.model, x.cfg, x.parallel.layout
    tp, ep, etp = layout.tensor_parallel, layout.expert_parallel, x.parallel.expert_tensor_parallel
    parts = lm_param_counts(model)
    dense_layer, expert_layer = lm_layer_params(model)
    vision = vision_param_count(model)
    vision_shard = tp if vision_is_megatron(model) else 1
    peft = cfg.peft is not None
    lm_frozen = model.freeze_language_model or peft
    adapters = adapter_counts(model, cfg.peft) if peft else None
    layers = x.parallel.stage_layers
    out = []
    for s, n in enumerate(layers):
        dense = n * dense_layer / tp + (parts["embedding"] / tp if s == 0 else 0)
        dense += (parts["output"] or (parts["embedding"] if len(layers) > 1 else 0)) / tp if s == len(layers) - 1 else 0
        expert = n * expert_layer / (ep * etp)
        if s == len(layers) - 1 and mtp_layers(model):  # MTP layers, and their copy of the embedding past stage 0
            mtp_dense, mtp_expert = mtp_layer_params(model)
            dense += mtp_layers(model) * mtp_dense / tp + (parts["embedding"] / tp if len(layers) > 1 else 0)
            expert += mtp_layers(model) * mtp_expert / (ep * etp)
        frozen, train_dense, train_expert = (dense + expert, 0.0, 0.0) if lm_frozen else (0.0, dense, expert)
        if s == 0:
            vis = vision / vision_shard
            if peft or (model.freeze_vision_model and model.freeze_vision_projection):
                frozen += vis
            else:
                train_dense += vis  # a frozen tower with a trainable merger: the merger is small; counted trainable
        if peft:  # adapters train, on the layers and the tower they adapt; frozen weights hold no gradient
            share, tower = n / model.num_layers, (adapters.vision + adapters.merger) / vision_shard if s == 0 else 0
            train_dense += share * adapters.language / tp + tower
            train_expert += share * adapters.experts / (ep * etp)
        out.append(StageParams(frozen=frozen, trainable_dense=train_dense, trainable_expert=train_expert))
    return out


def _in_flight(x: PlanInputs, stage: int) -> float:
    """Micro-batches whose activations one GPU of `stage` keeps at once under 1F1B (interleaving's penalty too)."""
    pp, vpp = x.parallel.layout.pipeline_parallel, x.parallel.layout.virtual_pipeline
    n = min(pp - stage, x.parallel.microbatches)
    return n * (1 + (pp - 1) / (pp * vpp)) if vpp else n


def _loss_bytes_per_logit(x: PlanInputs, weight_bytes: int) -> int:
    """Bytes per logit the loss keeps for backward: Megatron-Core's cross-entropies keep an fp32 softmax; qvl's fused
    one (qvl.kernels.speed_cross_entropy) keeps the logits."""
    return weight_bytes if x.lean_cross_entropy else 4


def _loss_rows(x: PlanInputs, tokens: float) -> float:
    """Of a micro-batch's `tokens`, those the output layer and the loss run at: with `qvl.loss_rows_only` (one
    context-parallel rank) at most the text share of the workload (the loss counts at no image token), else all."""
    settings = getattr(x.cfg, "qvl", None)
    if not getattr(settings, "loss_rows_only", False) or x.parallel.layout.context_parallel > 1:
        return tokens
    return tokens * (1 - x.workload.vision_token_fraction)


def vision_recompute_blocks(qvl_options: Any, vision: VisionShape) -> int:
    """How many of the HF vision tower's blocks recompute in backward under the config's `qvl` section."""
    if not getattr(qvl_options, "vision_recompute", False):
        return 0
    blocks = getattr(qvl_options, "vision_recompute_blocks", None)
    return vision.depth if blocks is None else blocks


def _stage_activations(x: PlanInputs, stage: int, weight_bytes: int) -> float:
    """Bytes of activations one GPU of pipeline stage `stage` keeps for backward."""
    cfg, model, lm, vision = x.cfg, x.model, x.lm, x.vision
    layout = x.parallel.layout
    tp, pp, cp = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel
    recompute, modules = model.recompute_granularity, list(model.recompute_modules or [])
    tokens = x.tokens
    vision_patches = sum(x.workload.images(vision.spatial_merge_size)) * cfg.train.micro_batch_size / cp
    tower_rows = vision_patches * x.tower_rows_per_patch  # a graphed tower's bucket pads its call
    qvl_options = getattr(cfg, "qvl", None)
    balanced = bool(getattr(qvl_options, "vision_balance", False))
    tower = dict(recompute_blocks=vision_recompute_blocks(qvl_options, vision), compiled_tower=x.compiled_vision_tower)
    layers = x.parallel.stage_layers[stage]
    acts = layer_activation_bytes(model, lm, tokens, recompute=recompute, modules=modules) * layers
    if stage == 0 and balanced:  # this rank keeps the activations of its 1/TP share of the images only
        acts += vision_activation_bytes(model, vision, vision_patches / tp, **tower)
        acts += tokens * 2 * lm.hidden_size
        acts += vision_balance_buffer_bytes(vision, vision_patches, tp)
    elif stage == 0:
        acts += vision_activation_bytes(model, vision, tower_rows, **tower)
        acts += tokens * 2 * lm.hidden_size
    if stage == pp - 1:  # the final norm's output, fp32 (same source), and what the loss keeps per logit
        logits = _loss_rows(x, tokens) * _loss_bytes_per_logit(x, weight_bytes) * padded_vocab(model)
        head = (tokens * 4 * lm.hidden_size + logits) / tp
        # each MTP depth: its eh_proj input (2h), one more decoder layer and one more pass through the loss
        mtp = tokens * 2 * lm.hidden_size * weight_bytes / tp
        mtp += layer_activation_bytes(model, lm, tokens, recompute=recompute, modules=modules) + head
        acts += head + mtp_layers(model) * mtp
    acts *= _in_flight(x, stage)
    if recompute == "full":  # one layer rebuilt at a time for backward
        acts += layer_activation_bytes(model, lm, tokens, recompute=None, modules=[])
    return acts + (grouped_experts_bytes(x, weight_bytes) if layers else 0.0)


def grouped_experts_bytes(x: PlanInputs, weight_bytes: int) -> float:
    """The transient bytes of patch group speed-grouped-experts (recipe option grouped_experts) in one MoE layer's
    backward (qvl.kernels.speed_grouped_experts): the local experts' `linear_fc1` weights stacked (the larger linear:
    2/3 of an expert's weights with a GLU) and, where the experts train, their stacked weight gradient and its fp32
    copy for main_grad. Zero without the option or without experts."""
    if not getattr(getattr(x.cfg, "qvl", None), "grouped_experts", False):
        return 0.0
    _, expert_layer = lm_layer_params(x.model)
    local = expert_layer / (x.parallel.layout.expert_parallel * x.parallel.expert_tensor_parallel)
    fc1 = local * (2 / 3 if x.model.gated_linear_unit else 1 / 2)
    trains = x.cfg.peft is None and not x.model.freeze_language_model
    return fc1 * (weight_bytes + (weight_bytes + 4 if trains else 0))


def _stage_memory(x: PlanInputs, params: list[StageParams]) -> list[StageMemory]:
    """Per pipeline stage: parameters, gradients, optimizer state and activations on one GPU."""
    cfg = x.cfg
    weight_b, grad_b, optim_b = _bytes_per_param(cfg)
    offload = cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else 0.0
    stages = []
    for s, stage in enumerate(params):
        mem = StageMemory(layers=x.parallel.stage_layers[s])
        mem.params = (stage.frozen + stage.trainable) * weight_b
        mem.grads = stage.trainable * grad_b
        mem.optimizer = (
            stage.trainable_dense / x.parallel.data_parallel + stage.trainable_expert / x.parallel.expert_data_parallel
        ) * optim_b
        mem.optimizer *= 1 - offload
        mem.activations = _stage_activations(x, s, weight_b)
        stages.append(mem)
    return stages


def plan_config(
    cfg: Any, *, gpus: int, gpu: str = "h100", workload: Workload | None = None, target: Target | None = None
) -> MemoryPlan:
    """Memory per GPU, pipeline split, FLOPs and an MFU estimate for `cfg` on `gpus` GPUs of kind `gpu`, with the
    kernels `target` runs (default: qvl.recipes.plan_inputs's, a CUDA device with this environment's packages)."""
    if gpu not in GPUS:
        raise ConfigError(f"gpu={gpu!r} is not known; use one of: {', '.join(GPUS)}")
    x = plan_inputs(cfg, gpus=gpus, gpu=GPUS[gpu], workload=workload, target=target)
    hw, model = x.gpu, x.model
    problems = _divisibility(x)
    stages = _stage_memory(x, _stage_params(x))
    usable = hw.memory_gib * GIB
    worst = max(range(len(stages)), key=lambda s: stages[s].total)
    if stages[worst].total > usable:
        problems.append(
            f"does not fit: pipeline stage {worst} needs {stages[worst].total / GIB:.1f} GiB per GPU, "
            f"the {hw.name} has {hw.memory_gib:.1f} GiB"
        )
    mbs = cfg.train.micro_batch_size
    costs = stage_costs(x.lm, x.vision, x.workload)
    fwd = [c * mbs for c in split_from_counts(list(x.parallel.stage_layers), costs).costs]
    total_params = sum(lm_param_counts(model).values()) + vision_param_count(model)
    trainable_total = _trainable_total(model, cfg, total_params)
    model_flops = 3 * sum(fwd) * cfg.train.global_batch_size / mbs
    step = _step_time(x, stage_flops=fwd, trainable_params=trainable_total)
    return MemoryPlan(
        gpus=gpus,
        gpu=hw,
        layout=x.parallel.sizes,
        stages=stages,
        stage_flops=fwd,
        params_total=total_params,
        params_trainable=trainable_total,
        model_flops_per_step=model_flops,
        step_time_s=step,
        mfu=model_flops / (step * gpus * _peak_flops(cfg, hw)),
        problems=problems,
        vision_share=vision_shares(model, costs, x.parallel.stage_layers[0]),
        vision_balance=bool(getattr(getattr(cfg, "qvl", None), "vision_balance", False)),
        mtp_share=mtp_flops(x.lm, x.workload) * mbs / sum(fwd),
    )


def mtp_flops(lm: LMShape, workload: Workload) -> float:
    """Forward FLOPs of one pack in the MTP layers (their own projections and norms, attention, MLP and logits)."""
    subs = workload.sub_sequences()
    return lm_flops(lm, subs) - lm_flops(replace(lm, mtp_layers=0), subs)


def _trainable_total(model: Any, cfg: Any, total: int) -> int:
    if cfg.peft is not None:
        return adapter_counts(model, cfg.peft).total
    frozen = sum(lm_param_counts(model).values()) if model.freeze_language_model else 0
    if model.freeze_vision_model and model.freeze_vision_projection:
        frozen += vision_param_count(model)
    return total - frozen


def _divisibility(x: PlanInputs) -> list[str]:
    cfg, gpus, hw, problems = x.cfg, x.gpus, x.gpu, []
    layout, etp = x.parallel.layout, x.parallel.expert_tensor_parallel
    ep, pp = layout.expert_parallel, layout.pipeline_parallel
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
        dp = x.parallel.data_parallel
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


def _peak_flops(cfg: Any, hw: GPU) -> float:
    fp8 = cfg.mixed_precision and "fp8" in str(cfg.mixed_precision) and hw.fp8_flops
    return hw.fp8_flops if fp8 else hw.bf16_flops


def _step_time(x: PlanInputs, *, stage_flops: list[float], trainable_params: int) -> float:
    """Roofline step time: bottleneck stage x (micro-batches + bubble), plus unoverlapped comms. `stage_flops`: forward
    FLOPs per micro-batch per pipeline stage."""
    model, hw, layout = x.model, x.gpu, x.parallel.layout
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    hidden = x.lm.hidden_size
    topk = (x.lm.moe_router_topk or 0) if x.lm.num_experts else 0
    recompute_factor = 4 / 3 if model.recompute_granularity == "full" else 1.0
    per_micro = max(stage_flops) * 3 * recompute_factor / (tp * layout.context_parallel)
    per_micro /= _peak_flops(x.cfg, hw) * GEMM_EFFICIENCY
    deepest = max(x.parallel.stage_layers)

    def bw(group: int) -> float:
        return hw.intra_node_bw if group <= hw.gpus_per_node else hw.inter_node_bw

    # TP: 2 all-reduces (or all-gather + reduce-scatter) of the activations per layer, forward and backward.
    if tp > 1:
        per_micro += deepest * 4 * 2 * (tp - 1) / tp * x.tokens * hidden * 2 / bw(tp)
    if topk and layout.expert_parallel > 1:
        ep = layout.expert_parallel
        local = x.tokens / (tp if model.sequence_parallel else 1)  # each TP rank dispatches its sequence shard
        per_micro += deepest * 4 * (ep - 1) / ep * local * topk * hidden * 2 / bw(ep * tp)
    vpp = layout.virtual_pipeline or 1
    step = per_micro * (x.parallel.microbatches + (pp - 1) / vpp)
    dp = x.parallel.data_parallel
    if dp > 1:  # reduce-scatter fp32 grads + all-gather bf16 params, not overlapped in VLM recipes
        step += (dp - 1) / dp * trainable_params / (tp * pp) * 6 / bw(x.gpus)
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


def _candidates(plan: MemoryPlan, overrides: dict, vision: dict | None) -> list[tuple[str, dict]]:
    """The single changes to try, cheapest first; `vision`: the HF vision tower's fewest recomputed blocks that fit
    (None: every block, which a Megatron tower's plan does not change with)."""
    tp, pp = plan.layout["tensor_parallel"], plan.layout["pipeline_parallel"]
    vision = vision or {"vision_recompute": True}
    out = [
        (" ".join(f"{k}={str(v).lower()}" for k, v in vision.items()), vision),
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


def vision_recompute_that_fits(
    make: Callable[[dict], Any], *, depth: int, limit_gib: float | None = None, **plan_kw: Any
) -> dict | None:
    """The recipe options that recompute the fewest of an HF vision tower's `depth` blocks for the plan of
    `make(options)` (a config) to fit, within `limit_gib` per GPU where given: {} where it fits without,
    `vision_recompute` (every block) or with `vision_recompute_blocks` (the first N); None where even every block
    recomputed does not fit. A tower's memory falls with each block recomputed: a bisection."""

    def options(blocks: int) -> dict:
        if blocks == 0:
            return {}
        return {"vision_recompute": True} | ({"vision_recompute_blocks": blocks} if blocks < depth else {})

    def fits(blocks: int) -> bool:
        plan = plan_config(make(options(blocks)), **plan_kw)
        return plan.fits and (limit_gib is None or plan.worst.total <= limit_gib * GIB)

    if fits(0):
        return {}
    if not fits(depth):
        return None
    low, high = 0, depth  # low does not fit, high does
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return options(high)


def _suggestions(info, overrides: dict, dotted: dict, plan: MemoryPlan, **kw) -> list[str]:
    """Changes that make the plan fit, each re-planned with the user's options and dotted fields kept; vision
    recompute of as few blocks as fit."""
    found: list[str] = []
    offload_found = False

    def make(change: dict) -> Any:
        return apply_config_overrides(info.fn(**{**overrides, **change}), dotted)

    for label, change in _candidates(plan, overrides, _fewest_recomputed_blocks(make, overrides, **kw)):
        if offload_found and "optimizer_offload" in change and "recompute" not in change:
            continue  # the smallest offload that fits is enough
        try:
            trial = plan_config(make(change), **kw)
        except ValueError:  # e.g. a TP that does not divide the heads
            continue
        if trial.fits:
            found.append(f"{label} ({trial.worst.total / GIB:.1f} GiB)")
            offload_found |= "optimizer_offload" in change
        if len(found) == 4:
            break
    return found


def _fewest_recomputed_blocks(make: Callable[[dict], Any], overrides: dict, **kw: Any) -> dict | None:
    """`vision_recompute_that_fits` for a replicated HF vision tower the user has not set recompute options for."""
    if overrides.get("vision_recompute") or "vision_recompute_blocks" in overrides:
        return None
    model = make({}).model
    if vision_is_megatron(model) or getattr(model, "vision_config", None) is None:
        return None
    return vision_recompute_that_fits(make, depth=model.vision_config.depth, **kw) or None
