"""One `bench_train` run, in the training child process: Megatron-Bridge's `pretrain()` on the packed or padded
loader, timed per micro-batch and per step (optionally profiled), and its figures: tokens/s, TFLOP/s and MFU three
ways, data wait, peak memory next to `qvl plan`. `benchmarks/bench_train.py` writes the specs and starts it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass, fields
from unittest import mock

import numpy as np
import torch

from benchmarks import train_plan
from benchmarks.compile_record import CompileRecord
from benchmarks.profile_breakdown import StepBreakdown
from qvl.foundation import patches

logger = logging.getLogger(__name__)

WARMUP_STEPS = 1
RESTART = 3  # a worker's exit code after a failed run: the driver starts a fresh one for the rest
PROFILED_STEPS = 2  # with --profile: two steps after a packed run's measured ones (benchmarks/profile_breakdown.py)


class _Recorder:
    """Per micro-batch: seconds the training loop waited for it, real sub-sequence lengths, image grids; per step:
    its end and its language-model loss."""

    def __init__(self):
        self.batches: list[dict] = []
        self.step_ends: list[float] = [time.perf_counter()]
        self.losses: list[float | None] = []

    def step_end(self, context) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_ends.append(time.perf_counter())
        loss = (context.loss_dict or {}).get("lm loss")
        if isinstance(loss, (tuple, list)):  # (sum, count) where losses are per token
            loss = loss[0] / loss[1]
        self.losses.append(None if loss is None else round(float(loss), 6))


RECORDER = _Recorder()


class _TimedLoader:
    """The training loader, timed: `next()` is where the training loop waits for data."""

    def __init__(self, inner, lengths_of):
        self.inner, self.lengths_of = inner, lengths_of

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        batch = next(self.inner)
        wait = time.perf_counter() - start
        grids = batch.image_grid_thw.tolist()
        RECORDER.batches.append({"wait": wait, "lengths": self.lengths_of(batch), "grids": grids})
        return batch


class PaddedLoader:
    """The packs' samples one per micro-batch, each padded to `pad_to` tokens (what training without packing does)."""

    def __init__(self, packed, *, pad_to: int, image_pad_id: int, merge_size: int):
        self.packed, self.pad_to, self.image_pad_id, self.merge = packed, pad_to, image_pad_id, merge_size
        self.queue: list = []
        self.real: dict[int, int] = {}

    def __iter__(self):
        return self

    def __next__(self):
        if not self.queue:
            self.queue = split_padded(next(self.packed), self.pad_to, self.image_pad_id, self.merge)
        batch, real = self.queue.pop(0)
        self.real[id(batch)] = real
        return batch

    def lengths_of(self, batch) -> list[int]:
        return [self.real.pop(id(batch))]


def split_padded(batch, pad_to: int, image_pad_id: int, merge: int) -> list[tuple]:
    """(one-sample batch padded to `pad_to`, real length) for each sub-sequence of a packed image batch."""
    from qvl.data.count import IGNORE_INDEX
    from qvl.data.encode import PackedBatch

    if batch.pixel_values_videos is not None:
        raise ValueError("the padded baseline handles image datasets only")
    cu, tokens = batch.cu_seqlens_q.tolist(), batch.tokens[0]
    merged = [int(np.prod(g)) // merge**2 for g in batch.image_grid_thw.tolist()]
    image, row, out = 0, 0, []
    for a, b in zip(cu, cu[1:]):
        first_image, wanted = image, int((tokens[a:b] == image_pad_id).sum())
        while wanted > 0:
            wanted -= merged[image]
            image += 1
        grids = batch.image_grid_thw[first_image:image]
        rows = int(grids.prod(-1).sum()) if len(grids) else 0
        extra = pad_to - (b - a)
        positions = batch.position_ids[:, :, a:b]
        pad_positions = positions.amax(-1, keepdim=True) + 1 + torch.arange(extra).view(1, 1, -1)
        padded = PackedBatch(
            __key__=[f"{batch.__key__[0]}/{a}"],
            __restore_key__=("padded", a),
            tokens=torch.cat([tokens[a:b], tokens[a].expand(extra)])[None],  # its first token: never a vision token
            labels=torch.cat([batch.labels[0, a:b], torch.full((extra,), IGNORE_INDEX)])[None],
            loss_mask=torch.cat([batch.loss_mask[0, a:b], torch.zeros(extra)])[None],
            position_ids=torch.cat([positions, pad_positions], dim=-1),
            cu_seqlens_q=torch.tensor([0, pad_to], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, pad_to], dtype=torch.int32),
            max_seqlen=pad_to,
            pixel_values=batch.pixel_values[row : row + rows] if rows else None,
            image_grid_thw=grids,
            pixel_values_videos=None,
            video_grid_thw=batch.video_grid_thw[:0],
            second_per_grid_ts=batch.second_per_grid_ts[:0],
            source_indices=[[]],
        )
        row += rows
        out.append((padded, b - a))
    return out


def bench_dataset_class():
    """QvlPackedDatasetConfig whose loader is timed and, in "padded" mode, unpacked (built on demand: it imports
    Megatron-Bridge)."""
    from qvl.data.encode import QwenVLPackedTaskEncoder
    from qvl.data.planned import PlannedPackLoader
    from qvl.recipes.base import QvlPackedDatasetConfig

    @dataclass(kw_only=True)
    class BenchDatasetConfig(QvlPackedDatasetConfig):
        mode: str = "packed"
        pad_to: int = 0

        def tower_calls_dataset(self) -> str | None:
            """Padded micro-batches are the packs' samples: the packs' tower calls are not theirs."""
            return super().tower_calls_dataset() if self.mode == "packed" else None

        def build_datasets(self, context):
            path = pathlib.Path(self.path)
            encoder = QwenVLPackedTaskEncoder(hf_path=pathlib.Path(self.hf_path), family=self.family)
            plan = json.loads((path / "report.json").read_text())["dp_plan"]
            packed = PlannedPackLoader(
                path,
                encoder,
                rank=0,
                data_parallel=1,
                global_batch_size=plan["global_batch_size"],  # the padded run re-slices the planned packs into samples
                micro_batch_size=1 if self.mode == "padded" else self.micro_batch_size,
                num_workers=self.num_workers,
            )
            if self.mode == "packed":
                return _TimedLoader(packed, lambda b: np.diff(b.cu_seqlens_q.tolist()).tolist()), None, None
            padded = PaddedLoader(
                packed,
                pad_to=self.pad_to,
                image_pad_id=encoder.rope.image_pad_id,
                merge_size=encoder.vision.merge_size,
            )
            return _TimedLoader(padded, padded.lengths_of), None, None

    return BenchDatasetConfig


def train_once(spec: dict) -> dict:
    """Train one variant as `spec` says; returns its raw measurements."""
    from qvl.foundation import distributed, megatron, runtime
    from qvl.training.loop import TrainRequest, prepare_config

    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed.free_port())
    cpu = not torch.cuda.is_available()
    if cpu:
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.pretrain import pretrain

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)
    from qvl.training.step import forward_step

    run_dir = pathlib.Path(spec["run_dir"])
    kind, peak_flops = gpu_kind()
    planned = train_plan.vision_recompute_from_plan(spec, kind) if spec.get("vision_recompute_from_plan") else None
    request = TrainRequest(
        recipe=spec["recipe"],
        overrides={**spec["overrides"], **(planned or {})},
        run_dir=run_dir,
        model="tiny" if spec["tiny"] else None,
    )
    _, config = prepare_config(request)
    config.checkpoint.save = config.checkpoint.load = None  # measure training, not checkpoint writing
    config.logger.tensorboard_dir = None
    config.logger.log_interval = 1000
    config.dataset.num_workers = spec["num_workers"]
    dataset = config.dataset
    config.dataset = bench_dataset_class()(
        **{f.name: getattr(dataset, f.name) for f in fields(dataset) if f.init},
        mode=spec["mode"],
        pad_to=spec["pad_to"],
    )
    RECORDER.__init__()  # one process trains every variant in turn; pretrain() tears its global state down
    callbacks = CallbackManager()
    callbacks.register("on_train_step_end", RECORDER.step_end)
    anatomy = _attach_anatomy(spec, config, callbacks)
    profiled = PROFILED_STEPS if spec.get("profile") and spec["mode"] == "packed" else 0
    breakdown = None
    if profiled:
        breakdown = StepBreakdown(run_dir / "profile.txt", first=spec["overrides"]["train_iters"] - profiled + 1)
        callbacks.register("on_train_step_start", breakdown.step_start)
        callbacks.register("on_train_step_end", breakdown.step_end)
    groups = RunGroups.of(config, off=spec.get("groups_off", ()))
    callbacks.register("on_train_step_end", groups.step_end)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with CompileRecord() as compiles, patches.applied(*groups.training), padded_checks(spec):  # as `qvl train`'s loop
        pretrain(config, forward_step, callbacks=callbacks)
    if anatomy is not None:
        return {"schedule": spec["schedule"], "steps": anatomy.steps}
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    raw = {
        "step_ends": RECORDER.step_ends,
        "batches": RECORDER.batches,
        "peak_memory_bytes": peak,
        "micro_batches_per_step": config.train.global_batch_size // config.train.micro_batch_size,
        "profiled_steps": profiled,
    }
    result = summarize(raw, config, gpu_peak_flops=peak_flops)
    result["losses"] = RECORDER.losses
    if planned is not None:
        result["vision_recompute_from_plan"] = planned
    result["patch_groups"] = groups.summary(config)
    result["loss_rows_only"] = config.qvl.loss_rows_only  # the output layer at the loss rows (qvl.kernels.loss_rows)
    result["compiles"] = compiles.summary()  # graph breaks and recompile-limit hits the census does not see
    if breakdown is not None:
        result["profile"] = breakdown.summary()
    if spec["mode"] == "packed":
        try:  # the plan beside the figures: a defect in it must not lose the run's measured ones
            result["plan"] = train_plan.planner_estimate(config, _step_figures(raw), kind)
        except Exception as error:  # noqa: BLE001
            logger.exception("qvl plan's estimate for the run failed")
            result["plan"] = {"error": f"{type(error).__name__}: {error}"[:500]}
    return result


@dataclass(kw_only=True, slots=True)
class RunGroups:
    """The patch groups of one run: what the switch decides for it on this device (`decided`), those applied around
    its loop (`training`: the decided training groups less `off`), and every group in place during its first step
    (`applied`: those applied when the model was built included)."""

    decided: tuple[str, ...]
    training: tuple[str, ...]
    off: tuple[str, ...]
    applied: tuple[str, ...] = ()
    tower: dict | None = None  # the vision tower's CUDA graphs after the last step (qvl.kernels.tower_graphs)
    layer_graphs: bool = False  # Megatron-Core made the layers' graphs (they are deleted when the loop ends)
    moe_blocks: dict | None = None  # how the MoE layers' blocks were graphed (`moe_block_modes`), None: no MoE layer

    @classmethod
    def of(cls, config, *, off, device: str | None = None) -> RunGroups:
        """The groups of a run of `config` on `device` (default: this process's), less `off`."""
        from qvl.kernels import switch

        target = switch.Target.of(config, device=device)
        unknown = set(off) - set(patches.GROUPS)
        if unknown:
            raise ValueError(f"no patch group {sorted(unknown)}; groups: {', '.join(patches.GROUPS)}")
        decided = tuple(d.group for d in switch.decide(target) if d.on)
        training = tuple(g for g in switch.training_groups(target) if g not in off)
        return cls(decided=decided, training=training, off=tuple(off))

    def step_end(self, context) -> None:
        if context.state.train_state.step == 0:  # the first step's end callbacks (the step is not counted yet)
            self.applied = tuple(g for g in patches.GROUPS if patches.is_applied(g))
        self.tower = tower_graph_stats(context.model)
        from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

        self.layer_graphs = bool(_CudagraphGlobalRecord.cudagraph_created)
        self.moe_blocks = moe_block_modes(context.model)

    def summary(self, config) -> dict:
        """The run's groups, whether its language model's layers ran as CUDA graphs, and its tower's graphs (marked
        graphed with the layers or alone, where the layers cannot be captured)."""
        from qvl.kernels.speed_cuda_graphs import graphs_requested, tower_graphs_allowed

        graphs = {"requested": graphs_requested(config.model), "tower_requested": tower_graphs_allowed(config.model)}
        if graphs["requested"]:
            graphs["created"] = self.layer_graphs
            if self.moe_blocks is not None:
                graphs["moe_blocks"] = self.moe_blocks
        if graphs["requested"] or graphs["tower_requested"]:
            graphs["vision_tower"] = self.tower
        return {"decided_on": list(self.decided), "applied_around_loop": list(self.training),
                "applied_in_step_1": list(self.applied), "left_off": list(self.off), "cuda_graphs": graphs}  # fmt: skip


def moe_block_modes(model: list) -> dict | None:
    """How many MoE layers of `model` (its chunks) replay their whole MoE block as one graph (`whole`:
    qvl.kernels.moe_block_graphs), their router and combine apart (`partial`), or neither (`eager`); None where it has
    no MoE layer."""
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    modes = {"whole": 0, "partial": 0, "eager": 0}
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, MoETransformerLayer):
                whole = hasattr(module, "cudagraph_manager_moe")
                modes["whole" if whole else "partial" if module.use_partial_cudagraphs else "eager"] += 1
    return modes if any(modes.values()) else None


def tower_graph_stats(model: list) -> dict | None:
    """What the vision tower's CUDA graphs did (the replicated HF tower's, `visual`, or Megatron-Bridge's Qwen3-VL
    tower's, `vision_model`; None: the model has none)."""
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(model[0])
    tower = getattr(unwrapped, "visual", None) or getattr(unwrapped, "vision_model", None)
    graphs = getattr(tower, "qvl_graphs", None)
    return None if graphs is None else graphs.stats()


def padded_checks(spec: dict) -> contextlib.AbstractContextManager:
    """The padded baseline reads the packed dataset's samples one per micro-batch, at its own seq_length (the longest
    sample) and global batch (as many samples as a packed step holds): the check of the dataset against the recipe
    (packs no longer than seq_length, the DP plan's global batch; qvl.recipes.datasets) is for packed runs."""
    if spec["mode"] != "padded":
        return contextlib.nullcontext()
    return mock.patch("qvl.recipes.base.check_dataset_matches_recipe", lambda config: None)


def check_spec(spec: dict) -> dict:
    """What `train_once` does before training, for a CUDA run of `spec` on any machine (`bench_train --rehearse`):
    the config built and validated as Megatron-Bridge's loop validates it (the dataset against the recipe) for each
    GPU kind lent (its plan may choose other vision blocks to recompute: each different config checked), and the
    patch groups a CUDA run of it applies, less those the spec leaves off."""
    from qvl.foundation import megatron
    from qvl.training.loop import TrainRequest, prepare_config

    megatron.import_megatron_bridge()
    from megatron.bridge.training.config import runtime_config_update

    plans = {gpu: train_plan.vision_recompute_from_plan(spec, gpu) if spec.get("vision_recompute_from_plan") else {}
             for gpu in train_plan.REHEARSED_GPUS}  # fmt: skip
    distinct = {json.dumps(planned, sort_keys=True): planned for planned in plans.values()}
    for planned in distinct.values():  # each lent kind's plan may recompute other vision blocks: each config
        request = TrainRequest(recipe=spec["recipe"], overrides={**spec["overrides"], **planned},
                               run_dir=pathlib.Path(spec["run_dir"]), model="tiny" if spec["tiny"] else None)  # fmt: skip
        _, config = prepare_config(request, cpu=False)
        with padded_checks(spec):
            runtime_config_update(config)  # what pretrain() does first: mixed precision resolved, then validate()
    groups = RunGroups.of(config, off=spec.get("groups_off", ()), device="cuda")
    return {"seq_length": config.model.seq_length, "global_batch_size": config.train.global_batch_size,
            "train_iters": config.train.train_iters, "groups_around_loop": list(groups.training),
            "vision_recompute_from_plan": plans, "configs_checked": len(distinct)}  # fmt: skip


def _attach_anatomy(spec: dict, config, callbacks):
    """For bench_idle: the global batch follows `spec["schedule"]` (packs per step) in this one run, through
    Megatron-Core's step batch-size schedule (its `rampup_batch_size` is ignored since 0.19, and Megatron-Bridge
    0.6.2 passes no schedule, so it is set when training starts); Megatron-Bridge's timers at level 2; a StepAnatomy
    recording every step."""
    if not spec.get("anatomy"):
        return None
    from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator

    from benchmarks.step_anatomy import StepAnatomy, batch_size_schedule

    config.train.global_batch_size = max(spec["schedule"])
    config.logger.timing_log_level = 2

    def start(context) -> None:
        reconfigure_num_microbatches_calculator(
            rank=torch.distributed.get_rank(),
            global_batch_size=config.train.global_batch_size,
            micro_batch_size=config.train.micro_batch_size,
            data_parallel_size=config.data_parallel_size,
            step_batch_size_schedule=batch_size_schedule(spec["schedule"]),
        )

    anatomy = StepAnatomy(batches=RECORDER.batches, profiled=set(spec["profiled_steps"]))
    callbacks.register("on_train_start", start)
    callbacks.register("on_train_step_start", anatomy.step_start)
    callbacks.register("on_train_step_end", anatomy.step_end)
    return anatomy


# --- figures -------------------------------------------------------------------------------------------------------


def _step_figures(raw: dict) -> list[dict]:
    """Per step (after warm-up): seconds, data-wait seconds, real tokens, sub-sequence lengths, image grids."""
    per_step, ends = raw["micro_batches_per_step"], raw["step_ends"]
    steps = []
    for step in range(len(ends) - 1):
        batches = raw["batches"][step * per_step : (step + 1) * per_step]
        lengths = [n for b in batches for n in b["lengths"]]
        steps.append(
            {
                "seconds": ends[step + 1] - ends[step],
                "wait": sum(b["wait"] for b in batches),
                "lengths": lengths,
                "grids": [g for b in batches for g in b["grids"]],
            }
        )
    return steps[WARMUP_STEPS : len(steps) - raw.get("profiled_steps", 0)]


def flops_per_step(config, step: dict) -> dict[str, float]:
    """Training FLOPs of one step three ways: Megatron-Bridge's formula (its ViT term included), qvl's cost model,
    and 6 x parameters x tokens."""
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    from qvl.foundation.cost import lm_flops, vision_flops_per_image
    from qvl.recipes.shapes import lm_param_counts, model_shapes, vision_param_count

    lengths, grids = np.asarray(step["lengths"]), np.asarray(step["grids"], np.int64).reshape(-1, 3)
    patches = int(grids.prod(-1).sum())
    bridge = num_floating_point_operations(
        config,
        batch_size=len(lengths),
        seqlen_sum=int(lengths.sum()),
        seqlen_squared_sum=int((lengths**2).sum()),
        num_vision_patches=patches,
    )
    lm, vision = model_shapes(config.model)
    qvl = 3 * (lm_flops(lm, lengths.tolist()) + float(vision_flops_per_image(vision, grids).sum() if patches else 0))
    params = sum(lm_param_counts(config.model).values()) + vision_param_count(config.model)
    return {"megatron_bridge": float(bridge), "qvl_cost_model": qvl, "six_n": 6.0 * params * float(lengths.sum())}


def summarize(raw: dict, config, *, gpu_peak_flops: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU three ways, data-wait fraction, peak memory of one run."""
    steps = _step_figures(raw)
    if not steps:
        raise RuntimeError("no step after warm-up was measured; pass --steps >= 2")
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(sum(s["lengths"]) for s in steps)
    flops = [flops_per_step(config, s) for s in steps]
    result = {
        "steps_measured": len(steps),
        "step_seconds": round(seconds / len(steps), 4),
        # each step's: a step where a vision tower bucket is captured (its second call) synchronises the device and
        # empties the allocator's cache, so the mean carries captures the median leaves out
        "step_seconds_each": [round(s["seconds"], 4) for s in steps],
        "step_seconds_median": round(float(np.median([s["seconds"] for s in steps])), 4),
        "tokens_per_s_per_gpu": round(tokens / seconds, 1),
        "data_wait_fraction": round(sum(s["wait"] for s in steps) / seconds, 4),
        "peak_memory_gib": None if raw["peak_memory_bytes"] is None else round(raw["peak_memory_bytes"] / 2**30, 2),
        "packs_per_s_consumed": round(len(steps) * raw["micro_batches_per_step"] / seconds, 2),
    }
    for name in ("megatron_bridge", "qvl_cost_model", "six_n"):
        rate = sum(f[name] for f in flops) / seconds
        result[f"tflops_{name}"] = float(f"{rate / 1e12:.4g}")  # significant digits: a tiny CPU run is ~0.001
        result[f"mfu_{name}"] = round(rate / gpu_peak_flops, 4) if gpu_peak_flops else None
    return result


def gpu_kind() -> tuple[str | None, float | None]:
    """The planner's GPU kind for this device and its dense bf16 peak FLOP/s, or (None, None) off the known GPUs."""
    from qvl.recipes.planner import GPUS

    if not torch.cuda.is_available():
        return None, None
    name = torch.cuda.get_device_name().lower()
    kind = next((k for k in ("h200", "h100", "a100") if k in name), None)
    return kind, (GPUS[kind].bf16_flops if kind else None)


# --- driver --------------------------------------------------------------------------------------------------------


def worker(spec_paths: list[pathlib.Path]) -> int:
    """Train each spec in turn; after a failed run, exit RESTART so the driver starts a fresh process for the rest."""
    for spec_path in spec_paths:
        spec = json.loads(spec_path.read_text())
        try:
            result = train_once(spec)
        # One variant failing (say, out of GPU memory at 8k) must not lose the others' figures: the error is the
        # result, with its traceback in train_log.txt. SystemExit too: Megatron and its helpers exit on some errors.
        except (Exception, SystemExit) as error:  # noqa: BLE001
            logger.exception("%s run at %s failed", spec["mode"], spec["overrides"]["seq_length"])
            pathlib.Path(spec["result"]).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"[:2000]}))
            return RESTART
        pathlib.Path(spec["result"]).write_text(json.dumps(result))
    return 0
