"""Training benchmark at real model shapes: `python -m benchmarks.bench_train --model qwen25_vl_3b` (`make bench-train`).

It builds a real-shape model from the published HF config with random weights (no download; `--layers K` cuts the
language model's depth, the vision tower stays whole), writes a LLaVA-like synthetic dataset (JPEG images at
LLaVA-665k's resolutions, log-normal text, ~8% text-only, ~5% multi-image), packs it with `qvl data prepare` at each
`--seq-length` (a DP plan for one GPU), and trains `--steps` steps of the model's pretrain recipe through
Megatron-Bridge's own `pretrain()`, each run in its own process, twice per length:
- packed: the planned-pack loader (worker processes, prefetch), one pack per micro-batch;
- padded: the same samples, one per micro-batch, padded to the longest sample (no packing).

It writes `bench_train.json`: tokens/s/GPU, TFLOP/s and MFU by Megatron-Bridge's formula (vision term included), by
qvl's cost model (qvl.data.cost, what the DP planner balances) and by the 6N rule; peak GPU memory next to `qvl plan`'s
estimate for the same config and the measured workload; the fraction of step time spent waiting for data; packed
over padded tokens/s; and the loader's packs/s in one process and with workers against the packs/s a step consumes.

`--model tiny` runs the same harness with the tiny random Qwen2.5-VL on CPU (the test suite does, so it never rots);
real shapes need a CUDA GPU. Step 1 (allocator warm-up, kernel selection) is left out of every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch

logger = logging.getLogger(__name__)

# --model -> (pretrain recipe, family, published size); "tiny" is the tiny random model of qvl.bridges.tiny.
MODELS = {
    "tiny": ("qwen25_vl_3b_pretrain", "qwen2_5_vl", None),
    "qwen2_vl_2b": ("qwen2_vl_2b_pretrain", "qwen2_vl", "2b"),
    "qwen25_vl_3b": ("qwen25_vl_3b_pretrain", "qwen2_5_vl", "3b"),
    "qwen3_vl_2b": ("qwen3_vl_2b_pretrain", "qwen3_vl", "2b"),
    "qwen3_vl_4b": ("qwen3_vl_4b_pretrain", "qwen3_vl", "4b"),
}
# (height, width) of typical LLaVA-665k sources: COCO, GQA, OCR-VQA, TextVQA, VG (as in bench_data).
RESOLUTIONS = ((480, 640), (375, 500), (427, 640), (640, 480), (336, 336), (768, 1024), (600, 800), (1024, 683))
WORDS = (
    "the image shows a person dog cat car street table window tree sky building red blue green small large "
    "left right next to on under holding sitting standing what is how many where why color number of in picture "
    "describe detail answer question two three people there are this that with near background foreground"
).split()
WARMUP_STEPS = 1
# The GPU-path issue's targets on one H100, bf16, no TE.
GOALS = {"mfu": 0.40, "packed_over_padded": 1.5, "data_wait": 0.02, "plan_error": 0.15}
RESTART = 3  # a worker's exit code after a failed run: the driver starts a fresh one for the rest
PROFILED_STEPS = 2  # with --profile: the last two steps of a packed run, left out of its figures


@dataclass(kw_only=True, slots=True)
class Setup:
    """One benchmark invocation."""

    model: str
    layers: int | None
    seq_lengths: tuple[int, ...]
    steps: int
    global_batch: int
    samples: int
    num_workers: int
    out: pathlib.Path
    padded: bool = True
    options: dict[str, object] = field(default_factory=dict)  # recipe options (`--set KEY=VALUE`)
    profile: bool = False  # torch.profiler over the last two steps of each packed run (left out of the figures)
    loader_only: bool = False  # no training: the loader's packs/s against what `qvl plan` says an H100 step needs


# --- inputs: model directory and dataset --------------------------------------------------------------------------


def write_model_dir(path: pathlib.Path, model: str, layers: int | None) -> pathlib.Path:
    """An HF directory with the model's config.json (real shape, or the tiny model with weights), the tiny tokenizer
    (its special-token ids are written into the config) and a processor with the family's real pixel budget."""
    from qvl.bridges.tiny import write_tiny_hf_checkpoint
    from qvl.foundation.families import TINY_TOKEN_IDS, get_family
    from qvl.foundation.tiny import write_tiny_hf_processor_dir
    from qvl.recipes.architectures import get_architecture, hf_config

    _, family, size = MODELS[model]
    if size is None:
        return write_tiny_hf_checkpoint(path, family)
    arch = get_architecture(family, size)
    config = hf_config(arch, **({"num_hidden_layers": layers} if layers else {}))
    for name, value in TINY_TOKEN_IDS.items():
        setattr(config, name, value)
    config.save_pretrained(path)
    write_tiny_hf_processor_dir(path, family)
    record = get_family(family)
    unit = record.patch_size * 2  # one LM image token is a 2 x 2 merge of patches
    processor = json.loads((path / "preprocessor_config.json").read_text())
    processor["size"] = {"shortest_edge": 4 * unit * unit, "longest_edge": 1280 * unit * unit}  # Qwen's defaults
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def write_llava_like(root: pathlib.Path, count: int, *, scale: float = 1.0, seed: int = 0) -> tuple[pathlib.Path, ...]:
    """`count` LLaVA-like conversations about random JPEG images; `scale` shrinks the images (CPU tests)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        kind = rng.choice(3, p=[0.08, 0.87, 0.05])
        n_images = [0, 1, int(rng.integers(2, 4))][kind]
        images = []
        for k in range(n_images):
            height, width = (max(int(d * scale), 32) for d in RESOLUTIONS[rng.integers(len(RESOLUTIONS))])
            pixels = rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)  # smooth-ish, JPEG-like size
            name = f"{index:06d}_{k}.jpg"
            Image.fromarray(pixels).resize((width, height)).save(media / name, quality=90)
            images.append(name)
        words = lambda: " ".join(rng.choice(WORDS, size=int(np.clip(rng.lognormal(3.5, 0.8), 3, 600))))
        turns = [{"from": "human", "value": "<image>\n" * n_images + words()}, {"from": "gpt", "value": words()}]
        record = {"id": f"s{index}", "conversations": turns}
        if images:
            record["image"] = images
        records.append(json.dumps(record))
    jsonl = root / "data.jsonl"
    jsonl.write_text("\n".join(records) + "\n")
    return jsonl, media


def prepare_dataset(setup: Setup, hf_dir: pathlib.Path, jsonl, media, seq_length: int) -> pathlib.Path:
    """`qvl data prepare` with a one-GPU DP plan of `global_batch` packs per step."""
    from qvl.data.prepare import PrepareConfig, prepare

    _, family, _ = MODELS[setup.model]
    output = setup.out / f"data-{seq_length}"
    prepare(
        PrepareConfig(
            input=jsonl,
            media_root=media,
            family=family,
            tokenizer=hf_dir,
            seq_length=seq_length,
            output=output,
            truncate=True,
            data_parallel=1,
            global_batch=setup.global_batch,
            model_config=hf_dir,
        )
    )
    return output


# --- the loader's throughput ---------------------------------------------------------------------------------------


def loader_packs_per_second(data: pathlib.Path, hf_dir: pathlib.Path, family: str, workers: int, count: int) -> float:
    """Packs/s the planned loader delivers with `workers` worker processes (0: in the training process), after the
    first micro-batch (worker start-up is a one-off)."""
    from qvl.data.load import PlannedPackLoader, QwenVLPackedTaskEncoder

    plan = json.loads((data / "report.json").read_text())["dp_plan"]
    encoder = QwenVLPackedTaskEncoder(hf_dir=hf_dir, family=family)
    loader = PlannedPackLoader(
        data, encoder, rank=0, data_parallel=1, global_batch=plan["global_batch"], num_workers=workers, prefetch=4
    )
    next(loader)
    if workers:
        time.sleep(2.0)  # the prefetch queue may fill as it would during the first training step; it is
        # bounded (workers x prefetch), so a long run measures the workers' steady rate, as below
    start = time.perf_counter()
    for _ in range(count):
        next(loader)
    elapsed = time.perf_counter() - start
    loader.close()
    return count / elapsed


# --- one training run (in its own process) -------------------------------------------------------------------------


class _Recorder:
    """Per micro-batch: seconds the training loop waited for it, real sub-sequence lengths, image grids."""

    def __init__(self):
        self.batches: list[dict] = []
        self.step_ends: list[float] = [time.perf_counter()]

    def step_end(self, context) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_ends.append(time.perf_counter())


RECORDER = _Recorder()


class _Profiler:
    """torch.profiler over steps `first`..`first + count - 1` (callbacks), then the top ops by device time to a file."""

    def __init__(self, path: pathlib.Path, first: int, count: int = 2):
        self.path, self.first, self.last, self.profiler = path, first, first + count - 1, None

    def step_start(self, context) -> None:
        if context.state.train_state.step + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def step_end(self, context) -> None:
        if self.profiler is None or context.state.train_state.step + 1 != self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.stop()
        events = self.profiler.key_averages()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        steps = self.last - self.first + 1
        self.path.write_text(
            f"steps {self.first}-{self.last} ({steps} steps), sorted by {sort}\n"
            + events.table(sort_by=sort, row_limit=40, max_name_column_width=90)
        )
        self.profiler = None


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
    from qvl.data.load import PackedBatch

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
    from qvl.data.load import PlannedPackLoader, QwenVLPackedTaskEncoder
    from qvl.recipes.base import QvlPackedDatasetConfig

    @dataclass(kw_only=True)
    class BenchDatasetConfig(QvlPackedDatasetConfig):
        mode: str = "packed"
        pad_to: int = 0

        def build_datasets(self, context):
            path = pathlib.Path(self.path)
            encoder = QwenVLPackedTaskEncoder(hf_dir=pathlib.Path(self.hf_path), family=self.family)
            plan = json.loads((path / "report.json").read_text())["dp_plan"]
            packed = PlannedPackLoader(
                path,
                encoder,
                rank=0,
                data_parallel=1,
                global_batch=plan["global_batch"],  # the padded run re-slices the planned packs into samples
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
    from qvl.foundation import distributed, megatron, patches, runtime
    from qvl.recipes.training.train import TrainRequest, prepare_config

    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed.free_port())
    cpu = not torch.cuda.is_available()
    if cpu:
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.pretrain import pretrain

    import qvl.bridges.registry  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)
    from qvl.recipes.training.step import forward_step

    run_dir = pathlib.Path(spec["run_dir"])
    request = TrainRequest(
        recipe=spec["recipe"], overrides=spec["overrides"], run_dir=run_dir, model="tiny" if spec["tiny"] else None
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
    profiled = PROFILED_STEPS if spec.get("profile") and spec["mode"] == "packed" else 0
    if profiled:
        profiler = _Profiler(run_dir / "profile.txt", first=spec["overrides"]["train_iters"] - profiled + 1)
        callbacks.register("on_train_step_start", profiler.step_start)
        callbacks.register("on_train_step_end", profiler.step_end)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with patches.applied("megatron-wheel"):  # the pip-installed megatron-core ships its dataset helpers built
        pretrain(config, forward_step, callbacks=callbacks)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    raw = {
        "step_ends": RECORDER.step_ends,
        "batches": RECORDER.batches,
        "peak_memory_bytes": peak,
        "micro_batches_per_step": config.train.global_batch_size // config.train.micro_batch_size,
        "profiled_steps": profiled,
    }
    kind, peak_flops = gpu_kind()
    result = summarize(raw, config, gpu_peak_flops=peak_flops)
    if spec["mode"] == "packed":
        result["plan"] = planner_estimate(config, _step_figures(raw), kind)
    return result


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

    from qvl.data.cost import lm_flops, vision_flops_per_image
    from qvl.recipes.planner import lm_param_counts, model_shapes, vision_param_count

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
        "tokens_per_s_per_gpu": round(tokens / seconds, 1),
        "data_wait_fraction": round(sum(s["wait"] for s in steps) / seconds, 4),
        "peak_memory_gib": None if raw["peak_memory_bytes"] is None else round(raw["peak_memory_bytes"] / 2**30, 2),
        "packs_per_s_consumed": round(len(steps) * raw["micro_batches_per_step"] / seconds, 2),
    }
    for name in ("megatron_bridge", "qvl_cost_model", "six_n"):
        rate = sum(f[name] for f in flops) / seconds
        result[f"tflops_{name}"] = round(rate / 1e12, 3)
        result[f"mfu_{name}"] = round(rate / gpu_peak_flops, 4) if gpu_peak_flops else None
    return result


def planner_estimate(config, steps: list[dict], gpu: str | None) -> dict | None:
    """`qvl plan`'s per-GPU memory for the config and the workload measured in the run."""
    from qvl.recipes.planner import GIB, plan_config
    from qvl.recipes.split import Workload

    if gpu is None:
        return None
    lengths = [n for s in steps for n in s["lengths"]]
    grids = np.asarray([g for s in steps for g in s["grids"]], np.int64).reshape(-1, 3)
    merge = config.model.vision_config.spatial_merge_size
    workload = Workload(
        seq_length=config.model.seq_length,
        sample_tokens=max(int(np.mean(lengths)), 1),
        vision_token_fraction=float(grids.prod(-1).sum() / merge**2 / max(sum(lengths), 1)),
        patches_per_image=max(int(grids.prod(-1).mean()) if len(grids) else 1, 1),
    )
    plan = plan_config(config, gpus=1, gpu=gpu, workload=workload)
    worst = plan.worst
    return {
        "gpu": gpu,
        "total_gib": round(worst.total / GIB, 2),
        "params_gib": round(worst.params / GIB, 2),
        "grads_gib": round(worst.grads / GIB, 2),
        "optimizer_gib": round(worst.optimizer / GIB, 2),
        "activations_gib": round(worst.activations / GIB, 2),
        "overhead_gib": round(worst.overhead / GIB, 2),
        "mfu_estimate": round(plan.mfu, 4),
    }


def gpu_kind() -> tuple[str | None, float | None]:
    """The planner's GPU kind for this device and its dense bf16 peak FLOP/s, or (None, None) off the known GPUs."""
    from qvl.recipes.planner import GPUS

    if not torch.cuda.is_available():
        return None, None
    name = torch.cuda.get_device_name().lower()
    kind = next((k for k in ("h200", "h100", "a100") if k in name), None)
    return kind, (GPUS[kind].bf16_flops if kind else None)


# --- driver --------------------------------------------------------------------------------------------------------


def _worker(spec_paths: list[pathlib.Path]) -> int:
    """Train each spec in turn; after a failed run, exit RESTART so the driver starts a fresh process for the rest."""
    for spec_path in spec_paths:
        spec = json.loads(spec_path.read_text())
        try:
            result = train_once(spec)
        # One variant failing (say, out of GPU memory at 8k) must not lose the others' figures: the error is the
        # result, with its traceback in train_log.txt.
        except Exception as error:  # noqa: BLE001
            logger.exception("%s run at %s failed", spec["mode"], spec["overrides"]["seq_length"])
            pathlib.Path(spec["result"]).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"[:2000]}))
            return RESTART
        pathlib.Path(spec["result"]).write_text(json.dumps(result))
    return 0


def variant_spec(setup: Setup, hf_dir: pathlib.Path, data: pathlib.Path, seq_length: int, mode: str) -> pathlib.Path:
    """Write the spec of one training run (packed, or padded to the longest sample) and return its path."""
    recipe, _, _ = MODELS[setup.model]
    rows = [json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines()]
    longest = max(max(r["lengths"]) for r in rows)
    samples_per_pack = float(np.mean([len(r["samples"]) for r in rows]))
    # The padded run's step holds about as many samples as a packed step, one per micro-batch.
    global_batch = setup.global_batch if mode == "packed" else max(round(setup.global_batch * samples_per_pack), 1)
    run_dir = setup.out / f"run-{seq_length}-{mode}"
    spec = {
        "recipe": recipe,
        "tiny": setup.model == "tiny",
        "mode": mode,
        "pad_to": longest,
        "num_workers": setup.num_workers,
        "profile": setup.profile,
        "run_dir": str(run_dir),
        "result": str(run_dir / "result.json"),
        "overrides": {
            "data": str(data),
            "hf_path": str(hf_dir),
            "seq_length": seq_length if mode == "packed" else longest,
            "train_iters": setup.steps + (PROFILED_STEPS if setup.profile and mode == "packed" else 0),
            "global_batch_size": global_batch,
            "micro_batch_size": 1,
            "warmup_iters": 1,
            "save_interval": 10**6,
            "log_interval": 10**6,
            **setup.options,
        },
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    return run_dir / "spec.json"


def train_all(setup: Setup, specs: list[pathlib.Path]) -> list[dict]:
    """Train the specs in child processes (Megatron state stays out of this one), and on a GPU each in its own: a
    finished pretrain() leaves its model and optimizer allocated (an H100 run measured the next run's peak on top
    of the last one's ~34 GiB, and a third run failed to allocate its gradient buffer). After a failed run the
    rest go to a fresh process."""
    log, results = setup.out / "train_log.txt", [pathlib.Path(json.loads(p.read_text())["result"]) for p in specs]
    log.write_text("")
    for result in results:
        result.unlink(missing_ok=True)
    per_process = 1 if torch.cuda.is_available() else len(specs)  # the tiny CPU runs share one (imports cost)
    while pending := [spec for spec, result in zip(specs, results, strict=True) if not result.is_file()]:
        command = [sys.executable, "-m", "benchmarks.bench_train", "--worker", *map(str, pending[:per_process])]
        root = pathlib.Path(__file__).resolve().parents[1]
        done = subprocess.run(command, capture_output=True, text=True, cwd=root)
        with log.open("a") as f:
            f.write(done.stdout + done.stderr)
        if done.returncode not in (0, RESTART) or not results[specs.index(pending[0])].is_file():
            raise RuntimeError(f"training failed (exit {done.returncode}); see {log}:\n{done.stderr[-3000:]}")
    return [json.loads(result.read_text()) for result in results]


def benchmark(setup: Setup) -> dict:
    """Prepare, train every variant, and summarise; writes OUT/bench_train.json."""
    _, family, _ = MODELS[setup.model]
    if setup.model != "tiny" and not torch.cuda.is_available() and not setup.loader_only:
        raise SystemExit(
            f"--model {setup.model} needs a CUDA GPU to train (real shapes); on CPU use --model tiny, or --loader-only"
        )
    setup.out.mkdir(parents=True, exist_ok=True)
    hf_dir = write_model_dir(setup.out / "hf", setup.model, setup.layers)
    jsonl, media = write_llava_like(setup.out / "samples", setup.samples, scale=1.0 if setup.model != "tiny" else 0.25)
    kind, peak = gpu_kind()
    results: dict = {
        "model": setup.model,
        "layers": setup.layers,
        "options": setup.options,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpu_kind": kind,
        "steps": setup.steps,
        "warmup_steps_excluded": WARMUP_STEPS,
        "num_workers": setup.num_workers,
        "runs": [],
        "loader": [],
    }
    modes = ("packed", "padded") if setup.padded else ("packed",)
    datasets = {n: prepare_dataset(setup, hf_dir, jsonl, media, n) for n in setup.seq_lengths}
    if setup.loader_only:
        for seq_length, data in datasets.items():
            needed = planned_packs_per_second(setup, hf_dir, data, seq_length)
            results["loader"].append(loader_row(data, hf_dir, family, setup, needed, what="h100_step_needs_planned"))
        results["checks"] = checks(results)
        (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))
        return results
    specs = [variant_spec(setup, hf_dir, datasets[n], n, mode) for n in setup.seq_lengths for mode in modes]
    measured = iter(train_all(setup, specs))
    for seq_length, data in datasets.items():
        row: dict = {"seq_length": seq_length} | {mode: next(measured) for mode in modes}
        if setup.padded and all("tokens_per_s_per_gpu" in row[mode] for mode in modes):
            row["packed_over_padded_tokens_per_s"] = round(
                row["packed"]["tokens_per_s_per_gpu"] / row["padded"]["tokens_per_s_per_gpu"], 3
            )
        results["runs"].append(row)
    (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))  # the training figures, even if
    for seq_length, data in datasets.items():  # the loader measurement below runs out of time
        consumed = next(r for r in results["runs"] if r["seq_length"] == seq_length)["packed"]
        results["loader"].append(loader_row(data, hf_dir, family, setup, consumed.get("packs_per_s_consumed")))
    results["checks"] = checks(results)
    (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))
    return results


def planned_packs_per_second(setup: Setup, hf_dir: pathlib.Path, data: pathlib.Path, seq_length: int) -> float:
    """Packs/s one H100 consumes by `qvl plan`'s step-time estimate for this model, packs and dataset."""
    from qvl.foundation import megatron
    from qvl.recipes.planner import plan_config
    from qvl.recipes.split import Workload
    from qvl.recipes.training.train import TrainRequest, prepare_config

    megatron.import_megatron_bridge()
    spec = json.loads(variant_spec(setup, hf_dir, data, seq_length, "packed").read_text())
    request = TrainRequest(recipe=spec["recipe"], overrides=spec["overrides"], run_dir=pathlib.Path(spec["run_dir"]))
    config = prepare_config(request, cpu=False)[1]
    rows = [json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines()]
    sample_tokens = int(np.mean([n for r in rows for n in r["lengths"]]))
    plan = plan_config(
        config, gpus=1, gpu="h100", workload=Workload(seq_length=seq_length, sample_tokens=sample_tokens)
    )
    return round(setup.global_batch / plan.step_time_s, 2)


def loader_row(data, hf_dir, family, setup: Setup, consumed: float, what: str = "consumed") -> dict:
    """Packs/s of the planned loader in one process and with workers, against the packs/s training consumes."""
    count = 8 if setup.model == "tiny" else 24
    row = {"seq_length": int(json.loads((data / "report.json").read_text())["seq_length"]), what: consumed}
    for workers in sorted({0, setup.num_workers or 2}):
        row[f"workers_{workers}"] = round(loader_packs_per_second(data, hf_dir, family, workers, count), 2)
    return row


def checks(results: dict) -> list[dict]:
    """The goals: workers out-deliver one process; on a GPU, the loader keeps up and the step never waits on data."""
    out = []
    for row in results["loader"]:
        one, many = row["workers_0"], max(v for k, v in row.items() if k.startswith("workers_") and k != "workers_0")
        out.append(
            {
                "figure": f"loader packs/s at {row['seq_length']}: workers / one process",
                "value": round(many / one, 2),
                "goal": "> 1",
                "met": many > one,
            }  # fmt: skip
        )
        if row.get("consumed") and results["gpu_kind"]:
            out.append(
                {"figure": f"loader packs/s at {row['seq_length']} with workers / packs/s the GPU step consumed",
                 "value": round(many / row["consumed"], 2), "goal": ">= 1", "met": many >= row["consumed"]}
            )  # fmt: skip
        if "h100_step_needs_planned" in row:
            needed = row["h100_step_needs_planned"]
            out.append(
                {"figure": f"loader packs/s at {row['seq_length']} with workers / planned H100 need",
                 "value": round(many / needed, 2), "goal": ">= 1 (else: more workers)", "met": many >= needed}
            )  # fmt: skip
    if results["gpu_kind"]:
        for run in results["runs"]:
            packed = run["packed"]
            if "error" in packed:
                out.append({"figure": f"packed run at {run['seq_length']}", "value": packed["error"][:200],
                            "goal": "runs", "met": False})  # fmt: skip
                continue
            n = run["seq_length"]
            out.append(
                {
                    "figure": f"data-wait fraction at {n}",
                    "value": packed["data_wait_fraction"],
                    "goal": f"< {GOALS['data_wait']}",
                    "met": packed["data_wait_fraction"] < GOALS["data_wait"],
                }
            )
            out.append(
                {
                    "figure": f"MFU (Megatron-Bridge formula), packed at {n}",
                    "value": packed["mfu_megatron_bridge"],
                    "goal": f">= {GOALS['mfu']}",
                    "met": (packed["mfu_megatron_bridge"] or 0) >= GOALS["mfu"],
                }
            )
            if "packed_over_padded_tokens_per_s" in run:
                ratio = run["packed_over_padded_tokens_per_s"]
                out.append(
                    {
                        "figure": f"packed / padded tokens/s at {n}",
                        "value": ratio,
                        "goal": f">= {GOALS['packed_over_padded']}",
                        "met": ratio >= GOALS["packed_over_padded"],
                    }
                )
            if packed.get("plan") and packed.get("peak_memory_gib"):
                error = packed["plan"]["total_gib"] / packed["peak_memory_gib"] - 1
                out.append(
                    {
                        "figure": f"qvl plan peak memory / measured - 1 at {n}",
                        "value": round(error, 3),
                        "goal": f"within +-{GOALS['plan_error']}",
                        "met": abs(error) <= GOALS["plan_error"],
                    }
                )
    return out


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the tiny model on CPU (or quick), else Qwen2.5-VL-3B shapes at 4k and 8k on the GPU."""
    tiny = quick or not torch.cuda.is_available()
    setup = default_setup("tiny" if tiny else "qwen25_vl_3b", out_dir / "bench_train")
    results = benchmark(setup)
    if tiny and not quick:
        results["why"] = "no CUDA GPU: the tiny model on CPU (harness check, not a speed figure)"
    (out_dir / "bench_train.json").write_text(json.dumps(results, indent=2))
    return results


def default_setup(model: str, out: pathlib.Path, **overrides) -> Setup:
    """Sizes per model: the tiny CPU run is seconds; real shapes train 8 steps of 8 packs at 4k and 8k."""
    if model == "tiny":
        base = dict(seq_lengths=(256,), steps=3, global_batch=2, samples=40, num_workers=2, layers=None)
    else:
        # 12 of Qwen2.5-VL-3B's 36 LM layers (real widths, whole ViT); the full depth's Adam state alone does not fit
        # one 80 GB GPU. On an H100 (benchmarks/RESULTS.md) the HF vision tower's activations did not fit at 4k
        # without vision recompute, and 8k packed did not fit even with it: its error is recorded as its result.
        base = dict(seq_lengths=(4096, 8192), steps=8, global_batch=8, samples=1000, num_workers=4, layers=12)
        base["options"] = {"vision_recompute": True}
    options = overrides.pop("options", None) or {}
    setup = Setup(model=model, out=out, **{**base, **{k: v for k, v in overrides.items() if v is not None}})
    setup.options = {**setup.options, **options}
    return setup


def main(argv: list[str] | None = None) -> int:
    """The command line (`make bench-train`); prints the JSON path and a one-line summary per run."""
    from qvl.recipes.overrides import parse_value, split_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=list(MODELS), default="tiny" if not torch.cuda.is_available() else "qwen25_vl_3b"
    )
    parser.add_argument("--layers", type=int, help="cut the language model to K layers (the ViT stays whole)")
    parser.add_argument(
        "--seq-length", type=int, nargs="+", dest="seq_lengths", help="pack lengths (default 4096 8192)"
    )
    parser.add_argument("--steps", type=int, help="training steps per run (the first is warm-up, left out)")
    parser.add_argument("--global-batch", type=int, help="packs per step")
    parser.add_argument("--samples", type=int, help="synthetic conversations to prepare")
    parser.add_argument("--num-workers", type=int, help="loader worker processes")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="recipe options, e.g. vision_recompute=true"
    )
    parser.add_argument("--no-padded", action="store_true", help="skip the padded baseline")
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler over two extra steps of each packed run (profile.txt)"
    )
    parser.add_argument(
        "--loader-only", action="store_true", help="no training (CPU): loader packs/s vs the planner's H100 step"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench/train"))
    parser.add_argument("--worker", type=pathlib.Path, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    options = {k: getattr(args, k) for k in ("layers", "steps", "global_batch", "samples", "num_workers")}
    options["seq_lengths"] = tuple(args.seq_lengths) if args.seq_lengths else None
    setup = default_setup(args.model, args.out, **options)
    setup.padded, setup.loader_only, setup.profile = not args.no_padded, args.loader_only, args.profile
    setup.options |= {key: parse_value(value) for key, value in map(split_pair, args.set)}
    results = benchmark(setup)
    for row in results["loader"]:
        print(f"loader {row}")
    for run in results["runs"]:
        for mode in ("packed", "padded"):
            if mode in run and "error" in run[mode]:
                print(f"{results['model']} {run['seq_length']} {mode}: FAILED {run[mode]['error'][:300]}")
            elif mode in run:
                r = run[mode]
                print(f"{results['model']} {run['seq_length']} {mode}: {r['tokens_per_s_per_gpu']} tokens/s/GPU, "
                      f"MFU {r['mfu_megatron_bridge']} (Bridge) {r['mfu_six_n']} (6N), "
                      f"data wait {r['data_wait_fraction']}, peak {r['peak_memory_gib']} GiB")  # fmt: skip
    print(f"wrote {args.out / 'bench_train.json'}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
