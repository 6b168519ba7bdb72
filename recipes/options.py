"""The keyword arguments every recipe takes, validated where they are given (not deep inside Megatron)."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from qvl.foundation.errors import ConfigError, DataError

# qvl precision name -> Megatron-Bridge mixed-precision recipe (training/mixed_precision.py); fp32 = none.
PRECISIONS = {
    "bf16-mixed": "bf16_mixed",
    "fp8-delayed": "bf16_with_fp8_delayed_scaling_mixed",
    "fp8-current": "bf16_with_fp8_current_scaling_mixed",
    "fp8-blockwise": "bf16_with_fp8_subchannel_scaling_mixed",
    "fp8-mxfp8": "bf16_with_mxfp8_mixed",
    "fp32": None,
}
RECOMPUTE = ("none", "selective", "full")
# Megatron-Core 0.19.2's selective-recompute modules that a Qwen-VL model has (not mla_up_proj: no Qwen-VL attention is
# multi-latent); what each needs of the model is checked where the recipe meets the model (qvl.recipes.base)
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "gdn_norm_out")
FREEZABLE = {
    "vision": "freeze_vision_model",
    "projector": "freeze_vision_projection",
    "language": "freeze_language_model",
}


@dataclass(kw_only=True, slots=True)
class RecipeOptions:
    """Everything a recipe can be told; defaults here are overridden per stage and per size."""

    hf_path: str  # local HF checkpoint dir (its config.json is read) or hub id; weights load at train time
    data: str | None = None  # a `qvl data prepare` output dir; planning needs none, training refuses without
    seq_length: int = 4096  # packed sequence length (THD, micro-batch 1 of packs)
    global_batch_size: int = 128
    micro_batch_size: int = 1
    train_iters: int | None = 1000  # None: one pass over `data` (its packs / global_batch_size), 1000 without data
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    context_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    vision_balance: bool = False  # vision tower data-parallel over stage 0's DP x TP ranks, each image once, by cost
    pipeline_split: str = "auto"  # "auto" (vision on stage 0, balanced), "uniform", or "FIRST,LAST" layer counts
    precision: str = "bf16-mixed"
    recompute: str = "none"
    recompute_layers: int | None = None  # full: recompute the first N layers of each stage (None = all)
    recompute_modules: tuple[str, ...] = ("core_attn",)  # selective: Megatron-Core recompute_modules
    vision_recompute: bool = False  # HF vision tower (Qwen2/2.5-VL): keep block inputs only, recompute the rest
    vision_recompute_blocks: int | None = None  # with vision_recompute: the first N blocks only (None = all)
    compile: bool = False  # HF vision tower (Qwen2/2.5-VL): each block torch.compiled on CUDA (Triton)
    # The language model's layers and the vision tower replayed as CUDA graphs (patch group speed-cuda-graphs, CUDA
    # without TE or Apex; a MoE layer's attention, router and combine, or with grouped_experts on one expert rank its
    # attention and whole MoE block; Gated DeltaNet layers stay eager); off until their
    # GPU tests have passed (tests/kernels/test_speed_cuda_graphs.py, tests/kernels/test_tower_graphs.py)
    cuda_graphs: bool = False
    # An MoE layer's local experts as two grouped GEMMs (patch group speed-grouped-experts, without TE): off until
    # its GPU test has passed (tests/kernels/test_speed_grouped_experts.py)
    grouped_experts: bool = False
    optimizer_offload: float = 0.0  # fraction of optimizer state on CPU (Megatron-Core hybrid-device optimizer)
    freeze: tuple[str, ...] = ()  # any of vision, projector, language
    # Multi-token prediction (Qwen3.5 / 3.6 / 3.8): train the checkpoint's MTP layers beside the LM, their loss
    # scaled by mtp_loss_scale (Megatron-Bridge's recipes: 0.1); off, the checkpoint's mtp.* export unchanged.
    # None (the SFT and PEFT default of those families) follows the checkpoint: its head trains where it has one.
    mtp: bool | None = False
    mtp_loss_scale: float = 0.1
    lr: float = 1e-5
    min_lr: float = 1e-6
    warmup_iters: int | None = 50  # None: a tenth of the training steps
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    # PEFT stage (qvl.bridges.adapters): the method, its rank, alpha and dropout, and what it adapts by meaning
    # (language, vision, merger, experts; qvl.foundation.families.ADAPTER_TARGETS), the same default for every family.
    adapter: str = "lora"  # lora or dora
    adapter_rank: int = 32
    adapter_alpha: int = 32
    adapter_dropout: float = 0.0
    adapter_targets: tuple[str, ...] = ("language",)
    # Preference stages (dpo, dpo_peft; qvl.recipes.preference): the loss (sigmoid, robust, ipo, hinge, simpo), its
    # beta, label smoothing, RPO's NLL weight, SimPO's margin, a side's log-prob as the sum or the mean over its
    # tokens, and the reference: a folder `qvl reference` wrote (default DATA/reference) or `adapters` (an adapter
    # recipe's base model: its adapters switched off).
    dpo_loss: str = "sigmoid"
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    dpo_nll_weight: float = 0.0
    simpo_gamma: float = 0.5
    dpo_logp: str = "sum"
    reference: str | None = None
    checkpoint_dir: str = "experiments/checkpoints"
    save_interval: int = 500
    pretrained_checkpoint: str | None = None  # converted Megatron checkpoint (`qvl convert import`)
    log_interval: int = 10
    tensorboard_dir: str | None = "experiments/tensorboard"
    wandb_project: str | None = None  # W&B logging only when a project is given
    seed: int = 1234

    def __post_init__(self) -> None:
        if isinstance(self.freeze, str):
            self.freeze = tuple(p for p in self.freeze.replace("+", ",").split(",") if p and p != "none")
        if isinstance(self.recompute_modules, str):
            self.recompute_modules = tuple(p for p in self.recompute_modules.split(",") if p)
        if isinstance(self.adapter_targets, str):
            self.adapter_targets = tuple(p for p in self.adapter_targets.replace("+", ",").split(",") if p)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("recompute", self.recompute, RECOMPUTE)
        for part in self.recompute_modules:
            _one_of("recompute_modules", part, RECOMPUTE_MODULES)
        for part in self.freeze:
            _one_of("freeze", part, FREEZABLE)
        if not 0.0 <= self.optimizer_offload <= 1.0:
            raise ConfigError(
                f"optimizer_offload={self.optimizer_offload} is a fraction; use a value in [0, 1], "
                "e.g. optimizer_offload=0.6"
            )
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "context_parallel",
            "expert_parallel",
            "micro_batch_size",
            "global_batch_size",
            "seq_length",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.virtual_pipeline is not None and self.pipeline_parallel < 2:
            raise ConfigError(
                f"virtual_pipeline={self.virtual_pipeline} needs pipeline_parallel >= 2 "
                f"(got {self.pipeline_parallel}); drop virtual_pipeline or raise it"
            )
        if self.mtp and self.context_parallel > 1:
            raise ConfigError(
                f"mtp=true needs context_parallel=1 (got {self.context_parallel}): qvl shifts the MTP targets inside "
                "each packed sample on one rank; set context_parallel=1 or mtp=false"
            )
        if self.vision_balance and self.context_parallel > 1:
            raise ConfigError(
                f"vision_balance=True needs context_parallel=1 (got {self.context_parallel}): the CP ranks of a "
                "replica each hold a slice of its sequences, and the step would have to send each embedding to "
                "the CP rank whose slice holds its placeholder tokens (not wired in); set context_parallel=1 or "
                "drop vision_balance"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size="
                f"{self.micro_batch_size}"
            )


def _one_of(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; use one of: {', '.join(allowed)}")


def option_names() -> list[str]:
    """The keyword arguments a recipe accepts (for the CLI's help and error messages)."""
    return [f.name for f in fields(RecipeOptions)]


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`; did you mean tensor_parallel?` for the closest names, or nothing."""
    close = difflib.get_close_matches(key, list(known), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_option_names(keys: Iterable[str], known: Iterable[str] | None = None) -> None:
    """Refuse a key that is not a recipe option (or not in `known`), suggesting the closest ones."""
    known = list(known) if known is not None else option_names()
    for key in keys:
        if key not in known:
            raise ConfigError(
                f"{key!r} is not a recipe option{did_you_mean(key, known)}; nested config fields use dots "
                "(train.train_iters=100), executor fields run.executor.<field>=... "
                "(`qvl train --help` lists the options)"
            )


def check_option_values(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each checked against its RecipeOptions type (ints stay ints, `5` for a float becomes 5.0)."""
    hints = typing.get_type_hints(RecipeOptions)
    defaults = {f.name: f.default for f in fields(RecipeOptions) if f.default is not MISSING}
    return {name: _typed(name, value, hints[name], defaults.get(name)) for name, value in values.items()}


def _typed(name: str, value: Any, hint: Any, default: Any) -> Any:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    if value is None and type(None) in members:
        return None
    kind = next((m for m in members if m is not type(None)), hint) if members else hint
    example = f" (e.g. {name}={default})" if default not in (None, MISSING, ()) else ""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be an integer{example}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}={value!r} must be a number{example}")
    if kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}={value!r} must be a string{example}")
    if typing.get_origin(kind) is tuple:
        if value is None:  # freeze=none
            return ()
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name}={value!r} must be a comma-separated list of names, e.g. {name}=a,b")
    return value


def make_options(defaults: dict, overrides: dict) -> RecipeOptions:
    """Options from stage/size defaults and user overrides; an unknown key is an error naming the closest ones."""
    check_option_names(overrides)
    merged = {**defaults, **check_option_values(overrides)}
    # Sequence parallelism comes with TP unless asked otherwise: it splits the LayerNorm/residual activations
    # that TP alone leaves replicated, at no extra communication (all-reduce becomes all-gather + reduce-scatter).
    merged.setdefault("sequence_parallel", merged.get("tensor_parallel", 1) > 1)
    return RecipeOptions(**merged)


# Learning rates and batch per stage; sizes override the parallel layout only.
STAGE_DEFAULTS: dict[str, dict] = {
    # Continued pretraining on image-text data: every part trains, higher LR, bigger batches.
    "pretrain": dict(lr=1e-4, min_lr=1e-5, warmup_iters=200, global_batch_size=256),
    # Full fine-tuning (Megatron-Bridge's Qwen-VL SFT LRs): a released checkpoint moves slowly.
    "sft": dict(lr=1e-5, min_lr=1e-6, warmup_iters=50, global_batch_size=128),
    # LoRA: adapters only (the base weights are frozen by the PEFT transform), adapter-sized LR.
    "peft": dict(lr=1e-4, min_lr=1e-5, warmup_iters=50, global_batch_size=128),
    # Preference training (DPO) after SFT, as published (Zephyr, Tulu 3, TRL's examples): a small LR, cosine to zero
    # after a tenth of the steps of warm-up, one pass over the pairs.
    "dpo": dict(lr=5e-7, min_lr=0.0, warmup_iters=None, train_iters=None, global_batch_size=64),
    "dpo_peft": dict(lr=5e-6, min_lr=0.0, warmup_iters=None, train_iters=None, global_batch_size=64),
}


def check_data_folder(path: str | Path | None) -> None:
    """Refuse a missing dataset, or a folder that `qvl data prepare` did not write, naming the option to fix."""
    if path is None:
        raise ConfigError("no dataset: pass data=DIR, a directory written by `qvl data prepare`")
    if not Path(path).is_dir():
        raise DataError(f"data={path} does not exist; pass the --output folder of `qvl data prepare`")
    if not (Path(path) / ".nv-meta").is_dir():
        raise DataError(f"data={path} is not a qvl packed dataset (no .nv-meta/); write one with `qvl data prepare`")
