"""The shared body of every family's base recipe: options + architecture -> Megatron-Bridge ConfigContainer.

Family modules (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`) own their sizes' default layouts and call
`build_config`; nothing here knows a family by name.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qvl.bridges.adapters import adapter_config, check_dora_layout
from qvl.bridges.checkpoints import checkpoint_tensor_names, has_checkpoint
from qvl.bridges.mtp_reference import checkpoint_mtp_names, mtp_layer_count
from qvl.bridges.providers import RecomputeVisionTowers, layout_facts, provider_from_hf
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import get_family
from qvl.foundation.layout import ParallelLayout, check_layout
from qvl.foundation.megatron import gated_delta_net, import_megatron_bridge
from qvl.recipes.architectures import Architecture, load_hf_config
from qvl.recipes.datasets import (
    QvlPackedDatasetConfig,
    build_dataset,
    check_dataset_matches_recipe,
    check_reference_matches,
)
from qvl.recipes.options import FREEZABLE, PRECISIONS, RecipeOptions
from qvl.recipes.preference import (
    ADAPTERS,
    PreferenceConfig,
    one_epoch_iters,
    preference_config,
)
from qvl.recipes.registry import ADAPTER_STAGES, PREFERENCE_STAGES
from qvl.recipes.split import Workload, balanced_split, counts, parse_split, split_from_counts, stage_costs

import_megatron_bridge()

import torch
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class QvlTrainingConfig:
    """qvl's own training settings, read by its forward step (qvl.training.step)."""

    # Vision work balanced over the first pipeline stage's DP x TP ranks (qvl.training.vision_balance).
    vision_balance: bool = False
    # The replicated HF vision tower (Qwen2-VL / Qwen2.5-VL) keeps only each block's input for backward and
    # recomputes the rest (qvl.bridges.providers.RecomputeVisionTowers); at 4k packs of LLaVA-like images its
    # activations are most of a step's (an H100 ran out of memory without it, Qwen2.5-VL-3B shapes, 12 layers).
    vision_recompute: bool = False
    # With vision_recompute: recompute the tower's first N blocks only (None: all), the later ones keep everything.
    vision_recompute_blocks: int | None = None
    # Each block of the replicated HF vision tower torch.compiled as one region where CUDA and Triton are
    # (qvl.kernels.speed_hf_vision.compile_vision_blocks); eager elsewhere. Off until its bf16 parity tests have run on
    # a GPU (tests/kernels/test_vision_compile.py).
    compile: bool = False
    # The language model's layers (a MoE layer's attention, router and combine; its whole MoE block with grouped
    # experts on one expert rank, qvl.kernels.moe_block_graphs) and the vision tower replayed as CUDA
    # graphs (qvl.kernels.speed_cuda_graphs, qvl.kernels.tower_graphs; the switch applies the group on CUDA without TE or
    # Apex). Off until the graphs' GPU tests have passed on a GPU.
    cuda_graphs: bool = False
    # An MoE layer's local experts as two grouped GEMMs instead of one expert after another (qvl.kernels.
    # speed_grouped_experts; the switch applies the group without TE). Off until its GPU test has passed on a GPU.
    grouped_experts: bool = False
    # IEEE fp32 products on CUDA where torch's convolutions and Triton's dots (flash-linear-attention's among them)
    # would round them to TF32 (qvl.kernels.fix_fla_tf32): slower; `qvl verify-training --precision fp32` sets it there.
    exact_fp32: bool = False
    # The output layer and the loss run at the positions whose loss counts only (qvl.kernels.loss_rows): not at image
    # placeholders, prompts or pad. The same loss and gradients (the output layer's weight gradient summed over fewer
    # rows may round its last bit differently); false runs them at every position, as Megatron-Core does.
    loss_rows_only: bool = True
    # A preference stage's loss and reference (qvl.recipes.preference); None trains the language-model loss (pretraining,
    # SFT, PEFT). The training loop picks its forward step by it (qvl.training.loop.stage_step).
    preference: PreferenceConfig | None = None


# Not slots: Megatron-Bridge's ConfigContainer is a plain dataclass.
@dataclass(kw_only=True)
class QvlConfigContainer(ConfigContainer):
    """Megatron-Bridge's ConfigContainer with a `qvl` section, so qvl's settings have a home of their own and
    travel with run_config.yaml (`qvl.vision_balance=true` overrides it like any other field)."""

    qvl: QvlTrainingConfig = field(default_factory=QvlTrainingConfig)

    def validate(self) -> None:
        """Megatron-Bridge's checks, then where the dataset meets the recipe, then qvl's own behaviours attached.

        Megatron-Bridge's `pretrain()`/`finetune()` call this before any model exists (runtime_config_update), so
        `qvl train`, `nemo qvl` and a notebook calling those loops with qvl's forward step behave the same."""
        super().validate()
        check_dataset_matches_recipe(self)
        check_reference_matches(self)
        check_mtp_checkpoint(self)
        attach_qvl_behaviours(self)


def attach_qvl_behaviours(config: Any) -> None:
    """Make the `qvl` section act wherever the config runs: `vision_recompute` and `compile` register their pre-wrap
    hooks (once)."""
    settings = getattr(config, "qvl", None)
    if settings is None:
        return
    if settings.vision_recompute:
        hook = RecomputeVisionTowers(blocks=settings.vision_recompute_blocks)
        _hf_tower_hook(config, "vision_recompute", hook, "recomputes with the language model (recompute=full)")
    if settings.compile:
        from qvl.kernels.speed_hf_vision import compile_vision_blocks

        _hf_tower_hook(config, "compile", compile_vision_blocks, "has no HF blocks to compile")


def _hf_tower_hook(config: Any, option: str, hook: Any, instead: str) -> None:
    """Register `hook` once for `option`, which only a replicated HF vision tower (Qwen2-VL / Qwen2.5-VL) takes."""
    family = getattr(config.dataset, "family", None)
    if family is None or get_family(family).megatron_vision_tower:
        raise ConfigError(
            f"{option}=True is for the replicated HF vision towers of Qwen2-VL / Qwen2.5-VL; {family}'s "
            f"tower is Megatron's and {instead}; drop {option}"
        )
    if hook not in getattr(config.model, "_pre_wrap_hooks", []):
        config.model.register_pre_wrap_hook(hook)


def build_config(*, arch: Architecture, stage: str, options: RecipeOptions) -> ConfigContainer:
    """A complete ConfigContainer for `arch` trained at `stage` with `options`."""
    o = resolve_steps(options)
    optimizer, scheduler = build_optimizer(o)
    model = build_model(arch, o)
    preference = None
    if stage in PREFERENCE_STAGES:
        preference = preference_config(o, adapters=stage in ADAPTER_STAGES)
        _check_preference_model(model, o, preference)
    return QvlConfigContainer(
        qvl=QvlTrainingConfig(
            vision_balance=o.vision_balance,
            vision_recompute=o.vision_recompute,
            vision_recompute_blocks=o.vision_recompute_blocks,
            compile=o.compile,
            cuda_graphs=o.cuda_graphs,
            grouped_experts=o.grouped_experts,
            preference=preference,
        ),
        model=model,
        train=TrainingConfig(
            train_iters=o.train_iters,
            global_batch_size=o.global_batch_size,
            micro_batch_size=o.micro_batch_size,
            manual_gc=True,
            manual_gc_interval=100,
        ),
        validation=ValidationConfig(eval_interval=o.save_interval, eval_iters=8),
        optimizer=optimizer,
        scheduler=scheduler,
        # Per-token loss over packs with varying numbers of learned tokens; no collective averaging then.
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            average_in_collective=False,
        ),
        dataset=build_dataset(arch, o, preference),
        logger=LoggerConfig(
            log_interval=o.log_interval,
            tensorboard_dir=o.tensorboard_dir,
            wandb_project=o.wandb_project,
            wandb_exp_name=Path(o.checkpoint_dir).parent.name,
        ),
        # Tokenization happens offline in `qvl data prepare`; the model only needs the vocabulary size.
        # (the vocabulary of the checkpoint actually used: hf_path may be a local or tiny model)
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=model.vocab_size),
        checkpoint=CheckpointConfig(
            save=o.checkpoint_dir,
            load=o.checkpoint_dir,
            save_interval=o.save_interval,
            pretrained_checkpoint=o.pretrained_checkpoint,
            ckpt_format="torch_dist",
        ),
        rng=RNGConfig(seed=o.seed),
        mixed_precision=PRECISIONS[o.precision],
        peft=build_adapters(arch, o) if stage in ADAPTER_STAGES else None,
    )


def resolve_steps(o: RecipeOptions) -> RecipeOptions:
    """`o` with its steps made numbers: train_iters=None is one pass over `data` (1000 without a dataset, when
    planning), warmup_iters=None a tenth of the training steps."""
    train_iters = o.train_iters or one_epoch_iters(o.data, o.global_batch_size) or 1000
    warmup = o.warmup_iters if o.warmup_iters is not None else train_iters // 10
    return dataclasses.replace(o, train_iters=train_iters, warmup_iters=warmup)


def _check_preference_model(model: Any, o: RecipeOptions, preference: PreferenceConfig) -> None:
    # A pair's sides are summed over whole sub-sequences: a context-parallel rank holds a slice of each.
    if o.context_parallel > 1:
        raise ConfigError(
            f"context_parallel={o.context_parallel}: a preference stage sums each side's log-probs over whole packed "
            "sequences, which context parallelism splits; use context_parallel=1"
        )
    if getattr(model, "mtp_num_layers", None):
        raise ConfigError(
            "mtp=true: preference stages train the language-model head only (the MTP head's loss has no pair "
            "objective); drop mtp=true (its weights export unchanged)"
        )
    # CUDA graphs replay the layers at the fixed shapes SFT's forward step gives each pack; a pair's step does not pad
    # to them, and reference=adapters would replay graphs captured with the adapters on.
    if o.cuda_graphs:
        raise ConfigError(
            "cuda_graphs=true: a preference step's packs are not padded to the graphs' fixed shapes, and "
            "reference=adapters runs the layers again with the adapters off, which a captured graph cannot; "
            "use cuda_graphs=false"
        )
    if preference.reference == ADAPTERS and o.pipeline_parallel > 1:
        raise ConfigError(
            f"reference=adapters runs the model a second time inside the step, which pipeline_parallel="
            f"{o.pipeline_parallel} cannot; precompute the reference (`qvl reference RECIPE ...`) or use "
            "pipeline_parallel=1"
        )


def build_adapters(arch: Architecture, o: RecipeOptions) -> Any:
    """The PEFT stage's adapters (qvl.bridges.adapters): the options' method, rank, alpha, dropout and targets."""
    check_dora_layout(o.adapter, o.tensor_parallel)
    return adapter_config(
        family=arch.family,
        method=o.adapter,
        targets=o.adapter_targets,
        rank=o.adapter_rank,
        alpha=o.adapter_alpha,
        dropout=o.adapter_dropout,
        seed=o.seed,
    )


def build_optimizer(o: RecipeOptions) -> tuple[OptimizerConfig, SchedulerConfig]:
    """Distributed Adam and its LR schedule (Megatron-Bridge's recipe defaults; its `recipes` package is not
    imported because it pulls in every model family's optional dependencies, e.g. diffusers)."""
    optimizer = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        bf16=o.precision != "fp32",
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    _offload(optimizer, o.optimizer_offload)
    scheduler = SchedulerConfig(
        start_weight_decay=o.weight_decay,
        end_weight_decay=o.weight_decay,
        weight_decay_incr_style="constant",
        lr_decay_style=o.lr_decay_style,
        lr_warmup_iters=o.warmup_iters,
        lr_warmup_init=0.0,
        lr_decay_iters=o.train_iters,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def build_model(arch: Architecture, o: RecipeOptions) -> Any:
    """The Megatron-Bridge provider with layout, pipeline split, recompute, freezing and dtype set."""
    model = provider_from_hf(load_hf_config(o.hf_path, arch))
    _apply_mtp(model, o, f"{arch.family} {arch.size}")
    _check_divisible(model, o, f"{arch.family} {arch.size}")
    _check_vision_balance(arch, o)
    _check_vision_recompute(model, o)
    model.seq_length = o.seq_length
    model.tensor_model_parallel_size = o.tensor_parallel
    model.pipeline_model_parallel_size = o.pipeline_parallel
    model.virtual_pipeline_model_parallel_size = o.virtual_pipeline
    model.context_parallel_size = o.context_parallel
    model.expert_model_parallel_size = o.expert_parallel
    model.sequence_parallel = o.sequence_parallel
    model.calculate_per_token_loss = True
    if getattr(model, "num_moe_experts", None) and o.expert_parallel > 1:
        model.moe_token_dispatcher_type = "alltoall"
    fp32 = PRECISIONS[o.precision] is None
    model.bf16, model.params_dtype = not fp32, torch.float32 if fp32 else torch.bfloat16
    model.pipeline_dtype = model.params_dtype if o.pipeline_parallel > 1 else None
    for part, flag in FREEZABLE.items():
        setattr(model, flag, part in o.freeze)
    _apply_recompute(model, o)
    _apply_split(model, o)
    return model


def _apply_mtp(model: Any, o: RecipeOptions, name: str) -> None:
    """Train the multi-token-prediction layers (qvl.training.mtp) or build none. `mtp=None` follows the checkpoint
    training starts from: its head trains where it has one, none is built where it has none, and one info line says
    which; `mtp=true` on a model or checkpoint without a head is refused, naming `mtp=false`."""
    configured = getattr(model, "mtp_num_layers", None) or 0
    model.mtp_num_layers = None  # none built unless trained: the checkpoint's mtp.* export unchanged (unconverted.py)
    if o.mtp is False:
        return
    if not configured:
        if o.mtp:
            raise ConfigError(f"mtp=true, but {name} has no multi-token-prediction layers (no mtp_num_hidden_layers "
                              "in its config.json); train with mtp=false")  # fmt: skip
        logger.info("multi-token prediction: hf_path=%s has no mtp_num_hidden_layers; training without", o.hf_path)
        return
    source, found = _mtp_layers_at_start(o, configured)
    if found and found != configured:
        raise ConfigError(f"{source} holds {found} MTP layer(s) where hf_path={o.hf_path}/config.json says "
                          f"mtp_num_hidden_layers={configured}; fix mtp_num_hidden_layers")  # fmt: skip
    if o.mtp and not found:
        raise ConfigError(f"mtp=true, but {source} has no multi-token-prediction weights (its MTP head was not saved "
                          "or not converted); train with mtp=false")  # fmt: skip
    if o.mtp is None:  # followed the checkpoint: say which way
        if not found or o.context_parallel > 1:
            why = f"an MTP head, but context_parallel={o.context_parallel} cannot train it" if found else "no MTP head"
            logger.info("multi-token prediction: %s has %s; training without", source, why)
            return
        logger.info("multi-token prediction: %s has %d MTP layer(s); training them (mtp=false leaves them aside)",
                    source, found)  # fmt: skip
    model.mtp_num_layers = configured
    model.mtp_loss_scaling_factor = o.mtp_loss_scale


def _mtp_layers_at_start(o: RecipeOptions, configured: int) -> tuple[str, int]:
    """(what, MTP layer count) of the weights training starts from: the run's own checkpoint when resuming, else the
    pretrained Megatron checkpoint, else the HF checkpoint's safetensors; a config alone (a hub id) holds what it
    says."""
    for option, path in (("checkpoint_dir", o.checkpoint_dir), ("pretrained_checkpoint", o.pretrained_checkpoint)):
        if path and (has_checkpoint(Path(path)) or (Path(path) / ".metadata").is_file()):
            names = checkpoint_tensor_names(Path(path), option)
            if option == "checkpoint_dir" and o.pretrained_checkpoint and _adapters_alone(names):
                continue  # a PEFT run saves its adapters alone: its base and MTP head stay the pretrained checkpoint's
            return f"{option}={path}", mtp_layer_count(names)
    if Path(o.hf_path).is_dir() and any(Path(o.hf_path).glob("*.safetensors")):
        return f"hf_path={o.hf_path}", mtp_layer_count(checkpoint_mtp_names(Path(o.hf_path)))
    return f"hf_path={o.hf_path}", configured


def _adapters_alone(names: list[str]) -> bool:
    """True when a checkpoint's model tensors are adapters only (a PEFT run's own checkpoints)."""
    model = [name for name in names if "/" not in name and not name.startswith(("optimizer.", "rng_state"))]
    return bool(model) and all(".adapter." in name for name in model)


def check_mtp_checkpoint(config: Any) -> None:
    """With MTP layers to train, the pretrained Megatron checkpoint (when not resuming) must hold them: refuse one
    converted without (an HF checkpoint without mtp.* tensors) before Megatron fails to load it. The recipe already
    chose from that checkpoint (`_apply_mtp`); this catches one set later (`checkpoint.pretrained_checkpoint=...`)."""
    if not getattr(config.model, "mtp_num_layers", None) or not config.checkpoint.pretrained_checkpoint:
        return
    if config.checkpoint.load and has_checkpoint(Path(config.checkpoint.load)):
        return
    path = Path(config.checkpoint.pretrained_checkpoint)
    if not mtp_layer_count(checkpoint_tensor_names(path, "pretrained_checkpoint")):
        raise ConfigError(
            f"the model trains {config.model.mtp_num_layers} multi-token-prediction layer(s), but "
            f"pretrained_checkpoint={path} has no MTP weights (it was converted from a checkpoint without mtp.* "
            "tensors); train with mtp=false"
        )


def _check_divisible(model: Any, o: RecipeOptions, name: str) -> None:
    layout = ParallelLayout(
        tensor_parallel=o.tensor_parallel,
        pipeline_parallel=o.pipeline_parallel,
        context_parallel=o.context_parallel,
        expert_parallel=o.expert_parallel,
        virtual_pipeline=o.virtual_pipeline,
    )
    check_layout(layout_facts(model, name), layout)
    if o.sequence_parallel and o.tensor_parallel == 1:
        raise ConfigError("sequence_parallel=True needs tensor_parallel >= 2; set sequence_parallel=False")
    fixed = "pipeline_parallel > 1" if o.pipeline_parallel > 1 else "cuda_graphs=True" if o.cuda_graphs else None
    if o.sequence_parallel and fixed and o.seq_length % o.tensor_parallel:
        raise ConfigError(
            f"seq_length={o.seq_length} is not a multiple of tensor_parallel={o.tensor_parallel}: with {fixed} every "
            "pack is padded to seq_length, which sequence parallelism splits evenly over the TP ranks; use "
            f"seq_length={o.seq_length // o.tensor_parallel * o.tensor_parallel}"
        )


def _check_vision_balance(arch: Architecture, o: RecipeOptions) -> None:
    # The balanced step runs the replicated HF tower and hands inputs_embeds to Qwen25VLModel.forward (Qwen2-VL's
    # too). Qwen3-VL's tower is Megatron's, sharded over TP, and feeds deepstack features into the decoder.
    if o.vision_balance and get_family(arch.family).megatron_vision_tower:
        raise ConfigError(
            f"vision_balance=True is not supported for {arch.family} yet: its vision tower is Megatron's, "
            "tensor-parallel itself (each rank holds 1/TP of its weights), so no rank can encode an image alone, "
            "and its deepstack features enter decoder layers the balanced step does not reach (docs/recipes.md: "
            "'Vision work over the DP x TP grid'); drop vision_balance"
        )


def _check_vision_recompute(model: Any, o: RecipeOptions) -> None:
    blocks = o.vision_recompute_blocks
    if blocks is None:
        return
    if not o.vision_recompute:
        raise ConfigError(f"vision_recompute_blocks={blocks} needs vision_recompute=true; set it, or drop "
                          "vision_recompute_blocks")  # fmt: skip
    depth = getattr(getattr(model, "vision_config", None), "depth", None)
    if depth is not None and not 1 <= blocks <= depth:
        raise ConfigError(f"vision_recompute_blocks={blocks} is not a block count of this vision tower (1 to "
                          f"{depth}); set one in that range, or drop it to recompute all {depth}")  # fmt: skip


def _apply_recompute(model: Any, o: RecipeOptions) -> None:
    if o.recompute == "selective":
        _check_recompute_modules(model, o.recompute_modules)
    model.recompute_granularity = None if o.recompute == "none" else o.recompute
    model.recompute_modules = list(o.recompute_modules) if o.recompute == "selective" else None
    if o.recompute == "full":
        # uniform x 1 = every layer keeps only its input; block x N = the first N layers of each stage do.
        model.recompute_method = "uniform" if o.recompute_layers is None else "block"
        model.recompute_num_layers = 1 if o.recompute_layers is None else o.recompute_layers


def _check_recompute_modules(model: Any, modules: tuple[str, ...]) -> None:
    """What Megatron-Core 0.19.2 refuses of a model's selective recompute, named as the recipe option is."""
    if "moe_act" in modules and not getattr(model, "moe_grouped_gemm", False):
        raise ConfigError(
            "recompute_modules=moe_act: Megatron-Core recomputes an expert's activation only in its grouped-GEMM "
            "experts (moe_grouped_gemm, with Transformer Engine); recompute the MoE layers whole "
            "(recompute_modules=moe) or drop moe_act"
        )
    if "gdn_norm_out" in modules and not gated_delta_net(model):
        raise ConfigError(
            "recompute_modules=gdn_norm_out: this model has no Gated DeltaNet layers (Qwen3.5-VL has them); "
            "drop gdn_norm_out"
        )


def _apply_split(model: Any, o: RecipeOptions) -> None:
    pp, vpp, layers = o.pipeline_parallel, o.virtual_pipeline, model.num_layers
    if pp == 1:
        return
    if o.pipeline_split == "auto":
        from qvl.recipes.shapes import model_shapes

        split = balanced_split(layers, pp, vpp, stage_costs(*model_shapes(model), Workload(seq_length=o.seq_length)))
        first, last = split.first, split.last
    else:
        first_last = parse_split(o.pipeline_split, layers, pp, vpp)
        if first_last is None:
            return
        first, last = first_last
    model.num_layers_in_first_pipeline_stage = first
    model.num_layers_in_last_pipeline_stage = last
    logger.info("pipeline split: %s layers per stage", counts(layers, pp, first, last))


def _offload(optimizer: Any, fraction: float) -> None:
    if fraction > 0:
        # Megatron-Core's HybridDeviceOptimizer keeps `fraction` of the fp32 master weights and Adam moments
        # (and their update) on the CPU; it needs the precision-aware distributed optimizer.
        optimizer.optimizer_cpu_offload = True
        optimizer.optimizer_offload_fraction = fraction
        optimizer.use_precision_aware_optimizer = True
        optimizer.overlap_cpu_optimizer_d2h_h2d = True


def split_of(model: Any) -> list[int]:
    """Per-stage LM layer counts of a configured provider."""
    return counts(
        model.num_layers,
        model.pipeline_model_parallel_size,
        model.num_layers_in_first_pipeline_stage,
        model.num_layers_in_last_pipeline_stage,
    )


__all__ = ["ConfigContainer", "QvlPackedDatasetConfig", "build_config", "build_model", "split_of", "split_from_counts"]
