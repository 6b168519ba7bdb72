"""What the planner computes a plan from, derived once per config: the GPU, the config's parallel layout on the
world (data parallel, pipeline stages, micro-batches), the model's shapes, the workload of one pack, and the kernels
the target GPU's run uses (qvl.kernels.switch), so no figure of the plan re-derives them (qvl.recipes.planner)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qvl.foundation.cost import LMShape, VisionShape
from qvl.foundation.layout import ParallelLayout
from qvl.kernels import switch
from qvl.recipes.shapes import model_shapes
from qvl.recipes.split import Workload, counts, workload_of_dataset


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

# --- what the planner reads from a config, derived once -------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelPlan:
    """A config's parallel layout on `gpus` GPUs, with what it implies: the data-parallel sizes that fill the rest of
    the world, the LM layers of each pipeline stage and the micro-batches each pipeline runs per step."""

    layout: ParallelLayout
    expert_tensor_parallel: int
    data_parallel: int
    expert_data_parallel: int
    stage_layers: tuple[int, ...]
    microbatches: int

    @property
    def sizes(self) -> dict[str, int]:
        """The sizes by option name (`MemoryPlan.layout`)."""
        layout = self.layout
        return dict(
            tensor_parallel=layout.tensor_parallel,
            pipeline_parallel=layout.pipeline_parallel,
            context_parallel=layout.context_parallel,
            expert_parallel=layout.expert_parallel,
            virtual_pipeline=layout.virtual_pipeline or 1,
            data_parallel=self.data_parallel,
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanInputs:
    """Everything a plan is computed from, derived once per config and passed down: the config, the GPU, the
    parallel plan, the model's shapes, the workload of one pack and the kernels the target GPU's run uses."""

    cfg: Any
    gpu: GPU
    gpus: int
    parallel: ParallelPlan
    lm: LMShape
    vision: VisionShape
    workload: Workload
    # qvl's fused cross-entropy serves the loss (it keeps the logits in the weights' dtype for backward, not an fp32
    # softmax): the target's run applies patch group speed-cross-entropy and the model fuses its cross-entropy
    lean_cross_entropy: bool
    # An HF vision tower runs speed-hf-vision's compiled regions (a CUDA run applying that group): it keeps less for
    # backward than transformers' eager tower (qvl.recipes.activations.hf_tower_bytes_per_patch)
    compiled_vision_tower: bool = False
    # Rows the vision tower runs (and keeps activations of) per patch: more than one where it replays as CUDA graphs,
    # each call padded up to its bucket (tower_rows_per_patch)
    tower_rows_per_patch: float = 1.0

    @property
    def model(self) -> Any:
        """The config's model provider."""
        return self.cfg.model

    @property
    def tokens(self) -> float:
        """LM tokens of one micro-batch on one context-parallel rank."""
        return self.workload.seq_length * self.cfg.train.micro_batch_size / self.parallel.layout.context_parallel


def parallel_plan(cfg: Any, gpus: int) -> ParallelPlan:
    """`cfg`'s parallel layout on `gpus` GPUs (data parallel at least 1: `_divisibility` reports a remainder)."""
    model = cfg.model
    layout = ParallelLayout(
        tensor_parallel=model.tensor_model_parallel_size,
        pipeline_parallel=model.pipeline_model_parallel_size,
        context_parallel=model.context_parallel_size,
        expert_parallel=model.expert_model_parallel_size,
        virtual_pipeline=model.virtual_pipeline_model_parallel_size,
    )
    etp = getattr(model, "expert_tensor_parallel_size", None) or layout.tensor_parallel
    dp = max(gpus // layout.model_parallel, 1)
    layers = counts(
        model.num_layers,
        layout.pipeline_parallel,
        model.num_layers_in_first_pipeline_stage,
        model.num_layers_in_last_pipeline_stage,
    )
    return ParallelPlan(
        layout=layout,
        expert_tensor_parallel=etp,
        data_parallel=dp,
        expert_data_parallel=max(gpus // (etp * layout.expert_parallel * layout.pipeline_parallel), 1),
        stage_layers=tuple(layers),
        microbatches=max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp), 1),
    )


def dataset_workload(cfg: Any, vision: VisionShape | None) -> Workload | None:
    """The workload of the prepared dataset the config trains on (its report.json), if it names one."""
    path = getattr(cfg.dataset, "path", None)
    report = Path(path) / "report.json" if path else None
    if report is None or not report.is_file():
        return None
    merge = vision.spatial_merge_size if vision is not None else 2
    return workload_of_dataset(json.loads(report.read_text()), seq_length=cfg.model.seq_length, merge=merge)


def plan_inputs(
    cfg: Any, *, gpus: int, gpu: GPU, workload: Workload | None = None, target: switch.Target | None = None
) -> PlanInputs:
    """What `plan_config` computes from: `workload` (the prepared dataset's, else the default mix) at the model's
    sequence length; the kernels of `target`'s run (default: a CUDA device with this environment's packages, which
    a launch from here installs), not this machine's."""
    model = cfg.model
    target = target or switch.Target.of(cfg, device="cuda")
    lm, vision = model_shapes(model)
    if workload is not None:
        workload = replace(workload, seq_length=model.seq_length)
    else:
        workload = dataset_workload(cfg, vision) or Workload(seq_length=model.seq_length)
    lean = bool(getattr(model, "cross_entropy_loss_fusion", False)) and switch.is_on("speed-cross-entropy", target)
    return PlanInputs(
        cfg=cfg,
        gpu=gpu,
        gpus=gpus,
        parallel=parallel_plan(cfg, gpus),
        lm=lm,
        vision=vision,
        workload=workload,
        lean_cross_entropy=lean,
        compiled_vision_tower=target.device == "cuda" and switch.is_on("speed-hf-vision", target),
        tower_rows_per_patch=tower_rows_per_patch(cfg, target),
    )


def tower_rows_per_patch(cfg: Any, target: switch.Target) -> float:
    """Rows the vision tower of `cfg`'s run on `target` runs per patch: where it replays as CUDA graphs
    (speed-cuda-graphs applied and the run's layout allows the tower's graphs), a call is padded up to its bucket:
    with sizes planned from the dataset's packs (qvl.kernels.tower_buckets), by the rows they add to its calls;
    else at most 1/BUCKETS_PER_DOUBLING more rows on the geometric grid. Without graphs, one."""
    if target.device != "cuda" or not switch.is_on("speed-cuda-graphs", target):
        return 1.0
    from qvl.kernels.speed_cuda_graphs import dataset_tower_calls, graphed_parts, planned_dataset, planned_size_count
    from qvl.kernels.tower_buckets import BUCKETS_PER_DOUBLING, planned_padding, tower_unit

    if not graphed_parts(cfg)[1]:
        return 1.0
    dataset, vision = planned_dataset(cfg), getattr(cfg.model, "vision_config", None)
    calls = dataset_tower_calls(dataset) if dataset and vision else ()
    if calls:
        return 1.0 + planned_padding(calls, unit=tower_unit(vision)[0], most=planned_size_count(cfg))
    return 1.0 + 1.0 / BUCKETS_PER_DOUBLING
