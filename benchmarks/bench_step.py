"""The step census: one training step of a recipe at real shapes, counted on CPU as a CUDA device runs it.

`python -m benchmarks.bench_step [--config NAME ...] [--quick] [--out .bench]` (part of `make bench`).

Each config trains two steps of its pretrain recipe through Megatron-Bridge's own `pretrain()` on the CPU, with the
model's real layer counts, tiny widths (`scaled_hf_config`) and packs of the real length and image sizes (LLaVA-like:
780-token samples, 62% image tokens, 1,936-patch images, 5 per 4k pack). The second step is recorded op by op
(benchmarks.step_census) and reported per step and per region (LM, vision tower, loss, optimizer, other):
kernel-launching ops, view ops, host syncs with call sites, GEMM FLOPs at the real widths and the share whose row
pitches are not 16-byte multiples, non-GEMM bytes per pack, host-to-device copies and the optimizer's largest
temporary. A small step-time model, calibrated on the H100 run of benchmarks/RESULTS.md, turns the counts into an
ESTIMATE of the step time, printed next to the 4.55 s measured there; it is a model, not a measurement.

Each config runs in its own process (Megatron's global state stays out of this one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
from dataclasses import asdict, dataclass
from unittest import mock

import numpy as np
import torch

logger = logging.getLogger(__name__)

# The H100 run the model is calibrated on (benchmarks/RESULTS.md, results/h100-2026-11-23/profile.txt): Qwen2.5-VL-3B
# shapes, 12 LM layers, vision recompute, 8 packs of 4k per step, bf16, no TE.
MEASURED_STEP_S = 4.552
PROFILE_PER_STEP = {"mm": 7536 // 2, "addmm": 5152 // 2}  # the profile covers two steps
PROFILE_KERNEL_S = 7.253 / 2  # GPU kernel time per step
PROFILE_GEMM_S = (2.059 + 1.174) / 2  # aten::mm + aten::addmm device time per step
PROFILE_ALIGN2_SHARE = 0.30  # share of all kernel time in cutlass_80 ... align2 kernels
PROFILE_ATTENTION_S = (0.279844 + 0.156065) / 2  # flash forward + backward per step
PROFILE_HOST_S = 8.827 / 2  # self CPU time per step: the host is busy the whole step
PROFILE_PAGEABLE_S = 0.134075 / 2  # Memcpy HtoD (Pageable -> Device) per step
# The step-speed goals for an 8-pack step of the RESULTS.md configuration (benchmarks/RESULTS.md, "Step census").
GOALS = {
    "kernel_launching_ops": 20_000,
    "host_syncs": 10,
    "misaligned_gemm_flop_share": 0.0,
    "nongemm_gb_per_pack": 120.0,
    "optimizer_ops": 50,
    "optimizer_largest_temporary_gib": 1.0,
    "estimated_step_s": 2.3,
}


@dataclass(kw_only=True, slots=True, frozen=True)
class StepConfig:
    """One census: a published architecture at `layers` LM layers, `packs` packs of `seq_length` per step."""

    name: str
    family: str
    size: str
    recipe: str
    layers: int | None = None  # None: the published depth
    vision_depth: int | None = None  # None: the published depth (tests shrink it)
    packs: int = 8
    seq_length: int = 4096
    samples_per_pack: int = 5
    image_grid: tuple[int, int, int] = (1, 44, 44)  # 1,936 patches: LLaVA-like images at Qwen's pixel budget
    text_tokens: int = 296  # per sample, besides its image's tokens (780 in all at a 44 x 44 grid)
    vision_recompute: bool = True


CONFIGS = {
    c.name: c
    for c in (
        StepConfig(name="qwen25_vl_3b_12l", family="qwen2_5_vl", size="3b", recipe="qwen25_vl_3b_pretrain", layers=12),
        StepConfig(name="qwen25_vl_3b", family="qwen2_5_vl", size="3b", recipe="qwen25_vl_3b_pretrain"),
        StepConfig(name="qwen2_vl_2b", family="qwen2_vl", size="2b", recipe="qwen2_vl_2b_pretrain"),
        StepConfig(name="qwen3_vl_4b", family="qwen3_vl", size="4b", recipe="qwen3_vl_4b_pretrain",
                   vision_recompute=False),
        # tests: the RESULTS.md configuration with one pack per step (counts per pack), and the same structure at
        # 2 LM layers, 4 ViT blocks, 2 short packs
        StepConfig(name="results_one_pack", family="qwen2_5_vl", size="3b", recipe="qwen25_vl_3b_pretrain",
                   layers=12, packs=1),
        StepConfig(name="tiny", family="qwen2_5_vl", size="3b", recipe="qwen25_vl_3b_pretrain", layers=2,
                   vision_depth=4, packs=2, seq_length=512, samples_per_pack=2, image_grid=(1, 6, 10),
                   text_tokens=60),
    )
}  # fmt: skip
RESULTS_CONFIG = "qwen25_vl_3b_12l"
DEFAULT_CONFIGS = ("qwen25_vl_3b_12l", "qwen25_vl_3b", "qwen2_vl_2b", "qwen3_vl_4b")

# Tiny widths: every one maps to one real width and none equals a dimension the model keeps (heads, KV heads, patch
# sizes, merge units), so shapes map back unambiguously. Head dims stay even (rotary), mRoPE sections sum to half.
TINY_LM_HEAD_DIM = 10
TINY_VOCAB = 608
TINY_FFN = 44
TINY_VISION_HEAD_DIM = {"qwen2_vl": 8, "qwen2_5_vl": 8, "qwen3_vl": 12}
TINY_VISION_FFN = 36
TINY_QWEN3_HIDDEN = 144


def scaled_hf_config(config: StepConfig):
    """(HF config with tiny widths and the real depths, WidthMap tiny -> real) for `config`."""
    import transformers

    from benchmarks.step_census import WidthMap
    from qvl.bridges.aligned import aligned
    from qvl.foundation.families import TINY_TOKEN_IDS, get_family
    from qvl.recipes.architectures import get_architecture

    arch = get_architecture(config.family, config.size)
    text, vision = dict(arch.text), dict(arch.vision)
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    real_head_dim = text.get("head_dim", text["hidden_size"] // heads)
    hd = TINY_LM_HEAD_DIM
    hidden = TINY_QWEN3_HIDDEN if "head_dim" in text else heads * hd
    rope = dict(text["rope_parameters"], mrope_section=[1, 2, 2])  # sums to hd / 2
    dims = {hidden: text["hidden_size"], heads * hd: heads * real_head_dim, kv * hd: kv * real_head_dim,
            (heads + 2 * kv) * hd: (heads + 2 * kv) * real_head_dim, hd: real_head_dim,
            TINY_FFN: text["intermediate_size"], 2 * TINY_FFN: 2 * text["intermediate_size"],
            TINY_VOCAB: text["vocab_size"]}  # fmt: skip
    text.update(hidden_size=hidden, intermediate_size=TINY_FFN, vocab_size=TINY_VOCAB, rope_parameters=rope)
    if "head_dim" in text:
        text["head_dim"] = hd
    if config.layers:
        text["num_hidden_layers"] = config.layers
    vhd = TINY_VISION_HEAD_DIM[config.family]
    width_key = "embed_dim" if "embed_dim" in vision else "hidden_size"
    real_width, vheads = vision[width_key], vision["num_heads"]
    vwidth = vheads * vhd
    dims |= {vwidth: real_width, 3 * vwidth: 3 * real_width, vhd: real_width // vheads, 4 * vwidth: 4 * real_width}
    vision[width_key] = vwidth
    if "intermediate_size" in vision:
        dims[TINY_VISION_FFN] = vision["intermediate_size"]
        if not get_family(config.family).megatron_vision_tower:  # qvl.bridges.aligned pads the HF tower's width
            dims.setdefault(aligned(TINY_VISION_FFN), aligned(vision["intermediate_size"]))
        vision["intermediate_size"] = TINY_VISION_FFN
    if width_key == "embed_dim":  # Qwen2-VL: hidden_size is the merger's output, the LM width
        vision["hidden_size"] = hidden
    else:
        vision["out_hidden_size"] = hidden
    if config.vision_depth:
        vision["depth"] = config.vision_depth
        if "fullatt_block_indexes" in vision:
            vision["fullatt_block_indexes"] = [config.vision_depth // 2 - 1, config.vision_depth - 1]
        if "deepstack_visual_indexes" in vision:
            vision["deepstack_visual_indexes"] = [0, config.vision_depth // 2]
    config_class = getattr(transformers, arch.config_class)
    hf = config_class(text_config=text, vision_config=vision, architectures=[arch.hf_architecture], **arch.top)
    for name, value in TINY_TOKEN_IDS.items():
        setattr(hf, name, value)
    return hf, WidthMap(dims=dims)


def write_model_dir(path: pathlib.Path, config: StepConfig) -> tuple[pathlib.Path, dict[int, int]]:
    """An HF directory (config, tiny tokenizer, processor) of the scaled model; returns it and the width map."""
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

    hf, widths = scaled_hf_config(config)
    hf.save_pretrained(path)
    write_tiny_hf_processor_dir(path, config.family)
    return path, widths.dims


# --- synthetic packs ----------------------------------------------------------------------------------------------


def synthetic_batches(config: StepConfig, hf_config, *, seed: int = 0, tower_inputs: bool = True):
    """Endless LLaVA-like packed micro-batches (qvl.data.encode.PackedBatch) of `config`'s composition: each sample
    text, one image, text; positions from qvl.data.mrope and (`tower_inputs`, HF towers) the tower's inputs from
    qvl.foundation.tower_inputs, as the loader computes them."""
    from qvl.data.count import IGNORE_INDEX
    from qvl.data.encode import PackedBatch
    from qvl.data.mrope import RopeConfig, packed_position_ids
    from qvl.foundation.families import get_family
    from qvl.foundation.tower_inputs import tower_inputs_for_config

    rng = np.random.default_rng(seed)
    vision = hf_config.vision_config
    merge = vision.spatial_merge_size
    patch_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    rope = RopeConfig(family=config.family, spatial_merge_size=merge, image_pad_id=hf_config.image_token_id,
                      video_pad_id=hf_config.video_token_id, tokens_per_second=getattr(vision, "tokens_per_second", 2))  # fmt: skip
    grid = config.image_grid
    image_tokens = math.prod(grid) // merge**2
    first = TINY_VOCAB // 8  # ordinary text ids: past the tiny tokenizer's special tokens
    while True:
        subs, media = [], []
        for _ in range(config.samples_per_pack):
            head = rng.integers(first, TINY_VOCAB, config.text_tokens // 3)
            tail = rng.integers(first, TINY_VOCAB, config.text_tokens - len(head) - 2)
            ids = np.r_[head, hf_config.vision_start_token_id, np.full(image_tokens, hf_config.image_token_id),
                        hf_config.vision_end_token_id, tail]  # fmt: skip
            subs.append(ids.astype(np.int64))
            media.append({"image_grid_thw": [list(grid)], "video_grid_thw": []})
        ids = np.concatenate(subs)
        lengths = [len(s) for s in subs]
        labels = np.r_[ids[1:], IGNORE_INDEX]
        learned = np.zeros(len(ids), dtype=bool)
        for end in np.cumsum(lengths):
            learned[end - len(tail) : end - 1] = True  # the answer: the sample's closing text
        labels[~learned] = IGNORE_INDEX
        patches = config.samples_per_pack * math.prod(grid)
        grids = torch.tensor([list(grid)] * config.samples_per_pack, dtype=torch.long)
        hf_tower = tower_inputs and not get_family(config.family).megatron_vision_tower
        yield PackedBatch(
            __key__=["synthetic"],
            __restore_key__=("synthetic",),
            tokens=torch.from_numpy(ids)[None],
            labels=torch.from_numpy(labels)[None],
            loss_mask=torch.from_numpy(learned.astype(np.float32))[None],
            position_ids=torch.from_numpy(np.ascontiguousarray(packed_position_ids(subs, media, rope)))[:, None],
            cu_seqlens_q=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            max_seqlen=max(lengths),
            pixel_values=torch.randn(patches, patch_width),
            image_grid_thw=grids,
            image_tower_inputs=tower_inputs_for_config(grids, vision) if hf_tower else None,
            pixel_values_videos=None,
            video_grid_thw=torch.zeros(0, 3, dtype=torch.long),
            second_per_grid_ts=torch.zeros(0),
            source_indices=[[]],
        )


# --- the training child ---------------------------------------------------------------------------------------------


def census_dataset_class():
    """A dataset config whose loader yields `synthetic_batches` (built on demand: it imports Megatron-Bridge)."""
    from megatron.bridge.training.config import DatasetProvider

    from qvl.recipes.base import QvlPackedDatasetConfig

    @dataclass(kw_only=True)
    class CensusDatasetConfig(QvlPackedDatasetConfig):
        batches: object = None  # an iterator of PackedBatch

        def finalize(self) -> None:
            DatasetProvider.finalize(self)  # no dataset folder to check: the packs are synthetic

        def build_datasets(self, context):
            return self.batches, None, None

    return CensusDatasetConfig


class _Regions:
    """Keeps `census.region` on the part of the model that runs: module hooks in forward, tensor hooks in backward
    (a gradient reaching a module's output starts that module's backward), and the grad-finalize function at the
    end of the micro-batches (after it, the optimizer)."""

    def __init__(self, census):
        self.census = census
        self.installed = False

    def set(self, region: str):
        self.census.region = region

    def backward_marker(self, region: str):
        def hook(grad):
            self.set(region)

        return hook

    def mark_output(self, output, region: str) -> None:
        from torch.utils import _pytree as pytree

        for leaf in pytree.tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple()):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self.backward_marker(region))

    def install(self, model: list, model_config) -> None:
        from megatron.core.utils import unwrap_model

        if self.installed:
            return
        self.installed = True
        vlm = unwrap_model(model[0])
        tower = next((getattr(vlm, n) for n in ("visual", "vision_model") if getattr(vlm, n, None) is not None), None)
        lm = vlm.language_model
        vlm.register_forward_pre_hook(lambda m, a: self.set("lm"))
        if tower is not None:
            tower.register_forward_pre_hook(lambda m, a: self.set("vision"))
            tower.register_forward_hook(lambda m, a, out: (self.mark_output(out, "vision"), self.set("lm"))[1])
        if getattr(lm, "output_layer", None) is not None:

            def before_output_layer(module, args):
                self.set("loss")
                self.mark_output(args[0], "lm")  # its gradient starts the decoder's backward

            lm.output_layer.register_forward_pre_hook(before_output_layer)
        vlm.register_forward_hook(lambda m, a, out: self.mark_output(out, "loss"))
        finalize = model_config.finalize_model_grads_func

        def finalize_then_optimizer(*args, **kwargs):
            self.set("other")
            result = finalize(*args, **kwargs)
            self.set("optimizer")
            return result

        model_config.finalize_model_grads_func = finalize_then_optimizer


def census_forward_step(census, regions: _Regions):
    """qvl's forward step with the region kept: "other" for the inputs, "loss" for the loss function."""
    from qvl.recipes.training.step import forward_step

    def step(state, data_iterator, model, return_schedule_plan: bool = False):
        regions.set("other")
        output, loss_func = forward_step(state, data_iterator, model)

        def loss(*args, **kwargs):
            regions.set("loss")
            return loss_func(*args, **kwargs)

        return output, loss

    return step


def _marked(batches, census):
    """The loader: each micro-batch's tensors (and those of its tower inputs) are host tensors."""
    for batch in batches:
        for value in (getattr(batch, f.name) for f in dataclasses.fields(batch)):
            if dataclasses.is_dataclass(value):  # TowerInputs
                value = [getattr(value, f.name) for f in dataclasses.fields(value)]
            census.mark_host(value)
        yield batch


def _numels(model: list, widths) -> None:
    """Real numels of each parameter's and each flat buffer's tiny numel (the distributed optimizer's shards and the
    gradient buffers are flat)."""
    for chunk in model:
        for param in chunk.parameters():
            widths.numels.setdefault(param.numel(), math.prod(widths.shape(tuple(param.shape))))
        for buffer in getattr(chunk, "buffers", []) or []:
            params = list(getattr(buffer, "params", []))
            tiny = sum(p.numel() for p in params)
            real = sum(math.prod(widths.shape(tuple(p.shape))) for p in params)
            if not tiny:
                continue
            for flat in [buffer.grad_data, getattr(buffer, "param_data", None)] + [
                b.grad_data for b in getattr(buffer, "buckets", [])
            ]:
                if flat is not None:
                    widths.numels.setdefault(flat.numel(), round(flat.numel() * real / tiny))


@contextlib.contextmanager
def cuda_code_path(census):
    """What the CPU run swaps so that it takes a CUDA device's code path (see benchmarks.step_census)."""
    from benchmarks.step_census import VARLEN_NAMES, fake_varlen_kernel
    from qvl.bridges import attention

    def usable(query, *, dropout_p: float = 0.0, padded_layout: bool = False) -> bool:
        return attention.varlen_supported(device_type="cuda", dtype=query.dtype, head_dim=query.shape[-1],
                                          dropout_p=dropout_p, padded_layout=padded_layout)  # fmt: skip

    import torch.optim.optimizer as optimizer_module

    devices = optimizer_module._get_foreach_kernels_supported_devices
    rng_state = torch.get_rng_state

    def host_rng_state():  # a host tensor on every device (Megatron's RNG tracker compares it after each fork)
        state = rng_state()
        census.mark_host(state)
        return state

    with (
        mock.patch.object(torch, "get_rng_state", host_rng_state),
        mock.patch.object(attention, "varlen_usable", usable),
        mock.patch.object(attention, "_varlen_kernel", lambda: (fake_varlen_kernel(census), VARLEN_NAMES)),
        mock.patch.object(optimizer_module, "_get_foreach_kernels_supported_devices",
                          lambda: [*devices(), "cpu"]),
    ):  # fmt: skip
        yield


# qvl's patch groups for a fast step besides optimizer_fixes.fixed()'s (those present in this tree).
STEP_GROUPS = ("lean-hf-vision",)


@contextlib.contextmanager
def step_code(*, baseline: bool):
    """qvl's step as training runs it, or (`baseline`) the code as measured on the H100 (RESULTS.md): no aligned widths, no lean vision
    tower (nor the loader's tower inputs), no step groups, only the torch-Adam resume fixes."""
    from qvl.foundation import patches
    from qvl.recipes.training import optimizer_fixes

    if baseline:
        with (
            mock.patch("qvl.bridges.fixes.align_vision_widths", lambda provider: {}),
            mock.patch("qvl.bridges.lean_vision.use_lean_vision", lambda provider: False),
            patches.applied(optimizer_fixes.GROUP),
        ):
            yield
        return
    # the copies a CUDA device gets: pinned, non-blocking (qvl.recipes.training.step.to_device)
    with mock.patch("qvl.recipes.training.step.pinned_copies", lambda device: True):
        with optimizer_fixes.fixed(), patches.applied(*(g for g in STEP_GROUPS if g in patches.GROUPS)):
            yield


def census_worker(spec_path: pathlib.Path) -> int:
    """Train two steps of the spec's config and write the census of the second (the training child)."""
    from benchmarks.step_census import Census, WidthMap
    from qvl.foundation import distributed, megatron, patches, runtime
    from qvl.recipes.training.train import TrainRequest, prepare_config

    spec = json.loads(spec_path.read_text())
    config = StepConfig(**{**spec["config"], "image_grid": tuple(spec["config"]["image_grid"])})
    out = pathlib.Path(spec["out"])
    os.environ.setdefault("MASTER_PORT", str(distributed.free_port()))
    runtime.activate(force=True)
    runtime.enable_bridge_training()
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.utils import get_model_config

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)

    hf_dir, dims = write_model_dir(out / "hf", config)
    hf, _ = scaled_hf_config(config)
    census = Census(WidthMap(dims=dims))
    overrides = {"hf_path": str(hf_dir), "seq_length": config.seq_length, "global_batch_size": config.packs,
                 "micro_batch_size": 1, "train_iters": 2, "warmup_iters": 1, "save_interval": 10**6,
                 "log_interval": 10**6, "precision": "bf16-mixed", "vision_recompute": config.vision_recompute}  # fmt: skip
    code = contextlib.ExitStack()  # the step's code, before or after: from the provider (aligned widths) on
    code.enter_context(step_code(baseline=spec["baseline"]))
    _, cfg = prepare_config(TrainRequest(recipe=config.recipe, overrides=overrides, run_dir=out / "run"))
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    dataset = cfg.dataset
    # made before training, as a loader's workers would: none of it is the step's work
    batches = list(itertools.islice(synthetic_batches(config, hf, tower_inputs=not spec["baseline"]), 2 * config.packs))
    cfg.dataset = census_dataset_class()(
        **{f: getattr(dataset, f) for f in ("hf_path", "family", "seq_length", "micro_batch_size")},
        path=None,
        num_workers=0,
        batches=_marked(batches, census),
    )
    regions = _Regions(census)
    stack = contextlib.ExitStack()
    losses = []

    def step_start(context):
        step = context.state.train_state.step + 1
        if step == 1:  # placement is followed from the first step (its optimizer state is made there)
            stack.enter_context(census.tracking())
        if step == 2:
            _numels(context.model, census.widths)
            regions.install(context.model, get_model_config(context.model[0]))
            regions.set("other")
            stack.enter_context(census.counted())

    def step_end(context):
        if context.state.train_state.step + 1 == 2:
            stack.close()
        loss = (context.loss_dict or {}).get("lm loss")
        if loss is not None:
            losses.append(float(loss[0] / loss[1]) if isinstance(loss, (tuple, list)) else float(loss))

    callbacks = CallbackManager()
    callbacks.register("on_train_step_start", step_start)
    callbacks.register("on_train_step_end", step_end)
    with code, cuda_code_path(census), patches.applied("megatron-wheel"):
        pretrain(cfg, census_forward_step(census, regions), callbacks=callbacks)
    result = {"config": asdict(config), "baseline": spec["baseline"], "losses": losses}
    result |= census.summary(config.packs)
    pathlib.Path(spec["result"]).write_text(json.dumps(result, indent=1))
    return 0


# --- the step-time model (an estimate, calibrated on one measured run) ------------------------------------------------

BEFORE_CENSUS = pathlib.Path(__file__).resolve().parent / "results" / "census-before.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class StepTimeModel:
    """Seconds per step from census counts: GEMMs at an aligned and a misaligned rate, attention at its rate,
    elementwise bytes at an effective bandwidth, pageable copies at their measured cost (the GPU's time); a cost per
    launching or view op (the host's time; the profile shows it busy the whole step); the step is the longer of the
    two plus a stall per host sync. Every rate is fitted to the H100 profile of benchmarks/RESULTS.md and the census
    of that same configuration before any change, so the model reproduces 4.55 s there by construction."""

    aligned_flops_per_s: float
    misaligned_flops_per_s: float
    attention_flops_per_s: float
    bytes_per_s: float
    pageable_copy_s: float
    host_s_per_op: float
    sync_s: float

    @classmethod
    def calibrated(cls, before: dict) -> StepTimeModel:
        """Fit to the census of the RESULTS.md configuration on the pre-change code (`before`'s "step")."""
        step = before["step"]
        misaligned_s = PROFILE_ALIGN2_SHARE * PROFILE_KERNEL_S
        pageable_s = PROFILE_PAGEABLE_S / max(step["h2d_pageable"], 1)
        elementwise_s = PROFILE_KERNEL_S - PROFILE_GEMM_S - PROFILE_ATTENTION_S - PROFILE_PAGEABLE_S
        host_s = PROFILE_HOST_S / (step["kernel_launching_ops"] + step["view_ops"])
        model = cls(
            aligned_flops_per_s=(step["gemm_tflop"] - step["gemm_misaligned_tflop"])
            * 1e12
            / (PROFILE_GEMM_S - misaligned_s),
            misaligned_flops_per_s=step["gemm_misaligned_tflop"] * 1e12 / misaligned_s,
            attention_flops_per_s=step["attention_tflop"] * 1e12 / PROFILE_ATTENTION_S,
            bytes_per_s=step["nongemm_gb"] * 1e9 / elementwise_s,
            pageable_copy_s=pageable_s,
            host_s_per_op=host_s,
            sync_s=0.0,
        )
        stall = (MEASURED_STEP_S - max(model.parts(step)["gpu_s"], model.parts(step)["host_s"])) / step["host_syncs"]
        return cls(**{**asdict(model), "sync_s": max(stall, 0.0)})

    def parts(self, step: dict) -> dict[str, float]:
        """The model's terms for one census step (seconds)."""
        aligned = (step["gemm_tflop"] - step["gemm_misaligned_tflop"]) * 1e12
        gpu = {
            "gemm_aligned_s": aligned / self.aligned_flops_per_s,
            "gemm_misaligned_s": step["gemm_misaligned_tflop"] * 1e12 / self.misaligned_flops_per_s,
            "attention_s": step["attention_tflop"] * 1e12 / self.attention_flops_per_s,
            "elementwise_s": step["nongemm_gb"] * 1e9 / self.bytes_per_s,
            "pageable_copies_s": step["h2d_pageable"] * self.pageable_copy_s,
        }
        host = (step["kernel_launching_ops"] + step["view_ops"]) * self.host_s_per_op
        return gpu | {"gpu_s": sum(gpu.values()), "host_s": host, "syncs_s": step["host_syncs"] * self.sync_s}

    def estimate(self, step: dict) -> dict[str, float]:
        """ESTIMATED seconds per step, with its terms."""
        parts = self.parts(step)
        total = max(parts["gpu_s"], parts["host_s"]) + parts["syncs_s"]
        return {k: round(v, 3) for k, v in (parts | {"estimated_step_s": total}).items()}


def goal_checks(result: dict, estimate: dict) -> list[dict]:
    """The step-speed goals for the RESULTS.md configuration, met or missed."""
    step, optimizer = result["step"], result["regions"]["optimizer"]
    figures = [
        ("kernel-launching ops per step", step["kernel_launching_ops"], GOALS["kernel_launching_ops"]),
        ("host syncs on device tensors per step", step["host_syncs"], GOALS["host_syncs"]),
        ("misaligned-GEMM FLOP share", step["misaligned_gemm_flop_share"], GOALS["misaligned_gemm_flop_share"]),
        ("non-GEMM GB per pack", step["nongemm_gb_per_pack"], GOALS["nongemm_gb_per_pack"]),
        ("optimizer-phase launching ops", optimizer["kernel_launching_ops"], GOALS["optimizer_ops"]),
        ("optimizer largest temporary GiB", optimizer["largest_temporary_gib"],
         GOALS["optimizer_largest_temporary_gib"]),
        (f"ESTIMATED step s (model; measured before: {MEASURED_STEP_S})", estimate["estimated_step_s"],
         GOALS["estimated_step_s"]),
    ]  # fmt: skip
    return [{"figure": f, "value": v, "goal": f"<= {g}", "met": v <= g} for f, v, g in figures]


def profile_match(result: dict) -> dict:
    """The census's mm / addmm counts next to the H100 profile's (same configuration, pre-change code)."""
    ops = result["step"]["ops"]
    return {name: {"census": ops.get(name, 0), "profile": count} for name, count in PROFILE_PER_STEP.items()}


# --- the driver -----------------------------------------------------------------------------------------------------


def census(config_name: str, out: pathlib.Path, *, baseline: bool = False) -> dict:
    """The census of one config, trained in a child process; raises with the child's log if it fails."""
    run_dir = out / f"step-{config_name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"config": asdict(CONFIGS[config_name]), "out": str(run_dir), "result": str(run_dir / "census.json"),
            "baseline": baseline}  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec))
    (run_dir / "census.json").unlink(missing_ok=True)
    root = pathlib.Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "benchmarks.bench_step", "--worker", str(run_dir / "spec.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root)
    (run_dir / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not (run_dir / "census.json").is_file():
        raise RuntimeError(f"census of {config_name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((run_dir / "census.json").read_text())


def benchmark(names: list[str], out: pathlib.Path, *, baseline: bool = False) -> dict:
    """Censuses of `names` (the pre-change code path with `baseline`), the step-time estimates and the goals."""
    results: dict = {"baseline": baseline, "configs": {}}
    for name in names:
        logger.warning("census of %s ...", name)
        results["configs"][name] = census(name, out, baseline=baseline)
    before = json.loads(BEFORE_CENSUS.read_text()) if BEFORE_CENSUS.is_file() else None
    if before is None and baseline and RESULTS_CONFIG in results["configs"]:
        before = results["configs"][RESULTS_CONFIG]
    if before is not None:
        model = StepTimeModel.calibrated(before)
        results["model"] = asdict(model)
        results["before"] = {"step": before["step"], "estimate": model.estimate(before["step"])}
        for name, result in results["configs"].items():
            if name != "tiny":
                result["estimate"] = model.estimate(result["step"])
    if RESULTS_CONFIG in results["configs"]:
        result = results["configs"][RESULTS_CONFIG]
        results["profile_match"] = profile_match(result)
        if "estimate" in result:
            results["checks"] = goal_checks(result, result["estimate"])
    (out / "bench_step.json").write_text(json.dumps(results, indent=1))
    return results


TABLE_ROWS = (
    ("kernel-launching ops", "kernel_launching_ops"),
    ("view ops", "view_ops"),
    ("host syncs", "host_syncs"),
    ("GEMM TFLOP", "gemm_tflop"),
    ("misaligned GEMM share", "misaligned_gemm_flop_share"),
    ("non-GEMM GB per pack", "nongemm_gb_per_pack"),
    ("pageable H2D copies", "h2d_pageable"),
)


def table(results: dict) -> str:
    """A short text table: each config's step figures (and the RESULTS.md config's before), then the goals."""
    names = list(results["configs"])
    columns = (["before"] if "before" in results else []) + names
    steps = ([results["before"]["step"]] if "before" in results else []) + [
        results["configs"][n]["step"] for n in names
    ]
    estimates = ([results["before"]["estimate"]] if "before" in results else []) + [
        results["configs"][n].get("estimate") for n in names
    ]
    optimizer = ([None] if "before" in results else []) + [results["configs"][n]["regions"]["optimizer"] for n in names]
    lines = [f"{'per step':32}" + "".join(f"{c:>18}" for c in columns)]
    for label, key in TABLE_ROWS:
        lines.append(f"{label:32}" + "".join(f"{s[key]:>18}" for s in steps))
    lines.append(
        f"{'optimizer ops (launching)':32}"
        + "".join(f"{o['kernel_launching_ops'] if o else '':>18}" for o in optimizer)
    )
    lines.append(
        f"{'ESTIMATED step s (model)':32}" + "".join(f"{e['estimated_step_s'] if e else '-':>18}" for e in estimates)
    )
    lines.append(f"measured before on an H100: {MEASURED_STEP_S} s per step (benchmarks/RESULTS.md)")
    for name, counts in results.get("profile_match", {}).items():
        lines.append(f"{name}: census {counts['census']}, H100 profile {counts['profile']} (pre-change code)")
    for check in results.get("checks", []):
        lines.append(
            f"{'met' if check['met'] else 'MISSED':7} {check['figure']}: {check['value']} (goal {check['goal']})"
        )
    return "\n".join(lines)


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the tiny config (quick) or the four real-shape configs."""
    names = ["tiny"] if quick else list(DEFAULT_CONFIGS)
    results = benchmark(names, out_dir)
    logger.warning("%s", table(results))
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line: run the censuses asked for, print the table (or JSON), write bench_step.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", choices=list(CONFIGS), help="configs (default: the four real ones)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    parser.add_argument("--quick", action="store_true", help="the tiny config only")
    parser.add_argument("--baseline", action="store_true", help="the pre-change code path (qvl's step fixes off)")
    parser.add_argument("--write-before", action="store_true", help=f"save the {RESULTS_CONFIG} census as the before")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return census_worker(args.worker)
    names = args.config or (["tiny"] if args.quick else list(DEFAULT_CONFIGS))
    if args.write_before and (RESULTS_CONFIG not in names or not args.baseline):
        print(f"error: --write-before needs --baseline and --config {RESULTS_CONFIG}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = benchmark(names, args.out, baseline=args.baseline)
    if args.write_before:
        BEFORE_CENSUS.write_text(json.dumps(results["configs"][RESULTS_CONFIG], indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
