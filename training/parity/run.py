"""One parity run: qvl's loop, then transformers' Trainer on the same conversations, then the comparison."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from qvl.foundation.errors import ConfigError, DataError
from qvl.foundation.families import family_of_architecture
from qvl.kernels import fix_fla_tf32, switch
from qvl.recipes.registry import all_recipes
from qvl.training import mtp
from qvl.training.parity import decay
from qvl.training.parity.adapters import adapter_notes
from qvl.training.parity.report import DELTA_RULES, ParityReport, compare, gate_note

logger = logging.getLogger(__name__)
MAX_PACKS = 64  # the reference accumulates every pack of the dataset in each step: a handful of samples
PRECISION_OPTIONS = {"fp32": "fp32", "bf16": "bf16-mixed"}
# Megatron-Core's native fused cross-entropy casts the logits' gradient to bf16 in every precision
# (megatron/core/fusions/fused_cross_entropy.py, calculate_gradients). Where qvl's training loop puts its own in its
# place (qvl.kernels.speed_cross_entropy: no Transformer Engine or Apex) the recipe's default is exact; elsewhere an fp32
# check turns the fusion off unless asked.
EXACT_CROSS_ENTROPY = {"model.cross_entropy_loss_fusion": False}
# Megatron adds its MoE load-balancing loss over each pack; transformers' own (output_router_logits=True) is another
# definition, so the reference adds Megatron's on transformers' routers (qvl.training.parity.moe_aux) where it can:
# one process and the token-weighted loss, full-model and PEFT recipes alike. Elsewhere the check compares the
# language-model loss alone.
NO_MOE_AUX_LOSS = {"model.moe_aux_loss_coeff": 0.0}
# The distributed optimizer leaves each data-parallel rank only its shard of the reduced gradients; plain DDP
# all-reduces them whole, so step 1's gradients can be exported and compared (the update is the same Adam).
WHOLE_GRADIENTS = {"optimizer.use_distributed_optimizer": False, "ddp.use_distributed_optimizer": False}
# fp32 on CUDA: IEEE fp32 products on qvl's side where torch's convolutions and Triton's dots would round to TF32
# (qvl.kernels.fix_fla_tf32; the reference runs under the same settings), so the fp32 tolerances can hold there.
EXACT_FP32 = {"qvl.exact_fp32": True}
# transformers builds no multi-token-prediction head; the check trains the published one beside it
# (qvl.training.parity.mtp) where the recipe trains MTP, except with adapters or a per-conversation reference loss.
NO_MTP = {"mtp": False}


@dataclass(kw_only=True, slots=True)
class ParitySpec:
    """A checkpoint, a prepared dataset of a handful of samples, and how long to train both frameworks."""

    hf_path: Path
    data: Path
    run_dir: Path
    recipe: str | None = None  # default: the family's smallest SFT recipe
    steps: int = 3
    options: dict[str, Any] = field(default_factory=dict)  # recipe options, e.g. lr=1e-4, warmup_iters=1
    precision: str = "fp32"  # "fp32" (CPU or GPU) or "bf16" (GPU)
    weight_decay_rule: str = "megatron"  # the reference's decay groups: "megatron" or "transformers" (Trainer's)
    loss_average: str = "token"  # the reference's loss: "token" (the recipe's) or "conversation" (Trainer's default)
    device: str = "auto"
    # Qwen3.5-VL's delta rule on qvl's side (DELTA_RULES); None: the recurrence where flash-linear-attention cannot
    # run, fla's chunked kernels where it can. "chunked" on the CPU keeps Megatron-Core's torch chunked kernel.
    delta_rule: str | None = None
    batch_hook: Callable[[Any, Any], Any] | None = None  # tests: change each batch on purpose before qvl's step


def checkpoint_family(hf_path: Path):
    """The family record of an HF checkpoint directory, from config.json's architectures."""
    config = Path(hf_path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{hf_path} has no config.json; pass an HF checkpoint directory")
    architectures = json.loads(config.read_text()).get("architectures") or []
    family = next((f for a in architectures if (f := family_of_architecture(a))), None)
    if family is None:
        raise ConfigError(f"{hf_path}: architecture {architectures} is not a Qwen-VL family qvl trains")
    return family


def default_recipe(family: str) -> str:
    """The family's smallest SFT recipe (its settings are the family's; the checkpoint sets the shapes)."""
    names = [r.name for r in all_recipes() if r.family == family and r.stage == "sft"]
    if not names:
        raise ConfigError(f"no SFT recipe is registered for {family}; pass --recipe")
    return names[0]


def dataset_report(data: Path) -> dict:
    """A `qvl data prepare` output's report.json, refusing one of more packs than every step can train."""
    report = Path(data) / "report.json"
    if not report.is_file():
        raise DataError(f"{data} has no report.json; pass the --output folder of `qvl data prepare`")
    content = json.loads(report.read_text())
    packs = int(content["packed_sequences"])
    if not 0 < packs <= MAX_PACKS:
        raise DataError(
            f"{data} holds {packs} packs; verification trains every pack in every step, so prepare a handful of "
            f"samples (1 to {MAX_PACKS} packs), e.g. `head -n 32 data.jsonl > few.jsonl` and `qvl data prepare`"
        )
    return content


def run_parity(spec: ParitySpec) -> ParityReport | None:
    """Train `spec.steps` steps in qvl (packed, Megatron-Bridge) and in transformers (unpacked) and compare.

    Under several processes (torchrun, or `run_on_ranks`) every rank trains qvl's side at the layout the options
    ask for (tensor_parallel=2, ...); rank 0 then trains the single-process reference and returns the report."""
    from qvl.training.parity.megatron_run import run_megatron

    family, device = check_spec(spec)
    run = qvl_run(spec, family, device)
    logger.info(
        "qvl: %d steps of %s on Megatron-Bridge, %d packs per step", spec.steps, run.recipe, run.global_batch_size
    )
    qvl, config = run_megatron(run)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
        return None  # rank 0 trains the reference and compares; the others only trained qvl's side
    hf, settings = reference_run(spec, family, qvl, config)
    report = compare(
        qvl, hf, family=family.name, recipe=run.recipe, precision=spec.precision, peak_lr=settings.lr,
        delta_rule=run.delta_rule,
    )  # fmt: skip
    report.deliberate = deliberate_differences(config, hf, settings) + cross_entropy_note(config, spec, device)
    report.deliberate += (moe_note(config) if family.moe else []) + run_notes(spec, settings) + gate_note(report)
    report.deliberate += adapter_notes(qvl.adapters) + mtp_note(config, spec) + exact_fp32_note(config)
    report.failures += decay.failure(qvl.decay, hf.decay)  # read from both optimizers: visible at any step count
    return report


def check_spec(spec: ParitySpec):
    """Refuse, before anything trains, what cannot be verified; the checkpoint's family record and the device."""
    if spec.precision not in PRECISION_OPTIONS:
        raise ConfigError(f"precision={spec.precision!r} is not supported; use fp32 or bf16")
    if spec.steps < 1:
        raise ConfigError(f"steps={spec.steps} trains nothing; use at least 1 (3 shows the schedule and Adam)")
    if 0 < int(spec.options.get("warmup_iters", 0)) >= spec.steps:
        raise ConfigError(
            f"warmup_iters={spec.options['warmup_iters']} does not fit {spec.steps} steps (Megatron-Bridge would cap it "
            "to a fraction of a step that transformers' schedulers cannot express); pass warmup_iters < --steps"
        )
    check_updates(spec)
    family = checkpoint_family(spec.hf_path)
    device = spec.device if spec.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if spec.precision == "bf16" and device == "cpu":
        raise ConfigError(
            "--precision bf16 runs on a GPU (qvl's CPU runtime trains in fp32); use --precision fp32 here"
        )
    dataset_report(spec.data)
    delta_rule_of(spec, device)
    return family, device


def fla_runs(device: str) -> bool:
    """Whether a Gated DeltaNet on `device` runs flash-linear-attention's kernels (else qvl's torch kernels)."""
    target = replace(switch.Target.of(device=device), gated_delta_net=True)
    return not switch.is_on("torch-gated-delta", target)


def delta_rule_of(spec: ParitySpec, device: str) -> str:
    """The delta rule qvl's side runs on `device` (a key of DELTA_RULES), refusing one it cannot run there."""
    if spec.delta_rule is not None and spec.delta_rule not in DELTA_RULES:
        raise ConfigError(f"delta_rule={spec.delta_rule!r} is not one; use one of: {', '.join(DELTA_RULES)}")
    if not fla_runs(device):
        return spec.delta_rule or "recurrence"
    if spec.delta_rule == "recurrence":
        raise ConfigError(
            "--delta-rule recurrence runs qvl's torch kernels, which a CUDA run with flash-linear-attention does not "
            "use; drop it (qvl's side then runs fla's chunked kernels, judged with the chunked gate tolerances) or "
            "pass --device cpu"
        )
    return "chunked"


def check_updates(spec: ParitySpec) -> None:
    """Refuse a multi-step check with a single optimizer update: Megatron's warm-up starts at lr 0, and Adam's first
    update is lr x sign(gradient) whatever its size, so the final weights and the loss trajectory could not show a
    gradient scaled wrong, the schedule or Adam's state (step 1's losses and gradients alone: --steps 1)."""
    warmup = int(spec.options.get("warmup_iters", 1 if spec.steps > 1 else 0))
    updates = spec.steps - (1 if warmup > 0 else 0)
    if spec.steps > 1 and updates < 2:
        raise ConfigError(
            f"--steps {spec.steps} with warmup_iters={warmup} makes {updates} optimizer update (the warm-up starts at "
            "lr 0), and Adam's first update is lr x sign(gradient), so the final weights and losses cannot show a "
            f"gradient's size, the schedule or Adam's state; use --steps {spec.steps + 2 - updates} or more, or "
            "--steps 1 for step 1's losses and gradients alone"
        )


def qvl_run(spec: ParitySpec, family, device: str):
    """qvl's side: the recipe on every pack of the dataset per step, with the check's defaults under the user's."""
    from qvl.training.parity.megatron_run import MegatronRun

    dataset = dataset_report(spec.data)
    recipe = spec.recipe or default_recipe(family.name)
    defaults = {
        "precision": PRECISION_OPTIONS[spec.precision],
        "seq_length": int(dataset["seq_length"]),
        # a recipe's warm-up (50 steps for SFT) outlasts a check of a few steps, and Megatron-Bridge then caps it
        # to a fraction of a step that transformers' schedulers cannot express
        "warmup_iters": 1 if spec.steps > 1 else 0,
        **(WHOLE_GRADIENTS if _data_parallel(spec.options) > 1 else {}),
        **(EXACT_CROSS_ENTROPY if spec.precision == "fp32" and not lean_cross_entropy(device) else {}),
        **(EXACT_FP32 if spec.precision == "fp32" and device == "cuda" else {}),
        **(NO_MOE_AUX_LOSS if family.moe and not moe_aux_comparable(spec) else {}),
        **(NO_MTP if not mtp_comparable(spec, recipe) else {}),
    }
    return MegatronRun(
        recipe=recipe,
        hf_path=Path(spec.hf_path),
        data=Path(spec.data),
        run_dir=Path(spec.run_dir) / "qvl",
        steps=spec.steps,
        global_batch_size=int(dataset["packed_sequences"]),  # every pack in every step
        options={**defaults, **spec.options},
        device=device,
        delta_rule=delta_rule_of(spec, device),
        batch_hook=spec.batch_hook,
    )


def mtp_comparable(spec: ParitySpec, recipe: str) -> bool:
    """Whether the reference can train the MTP head as qvl's recipe does: a full-model recipe (adapters leave the
    head to a later round) and the token-weighted loss the MTP term is defined with."""
    stage = next((r.stage for r in all_recipes() if r.name == recipe), None)
    return stage != "peft" and spec.loss_average == "token"


def moe_aux_comparable(spec: ParitySpec) -> bool:
    """Whether the reference can add Megatron's load-balancing loss as qvl's side does (qvl.training.parity.moe_aux):
    the token-weighted loss it is defined with, on one model replica (every process a tensor or pipeline share of it,
    so that each pack's expert counts are the whole pack's; data-parallel replicas train different packs); with
    adapters too, at the recipe's coefficient (frozen routers still steer the adapters' gradients)."""
    return _data_parallel(spec.options) == 1 and spec.loss_average == "token"


def moe_aux(config) -> tuple[str, float] | None:
    """(load-balancing type, coefficient) where qvl's run added Megatron's MoE load-balancing loss, else None."""
    model = config.model
    if not getattr(model, "num_moe_experts", None) or not model.moe_aux_loss_coeff:
        return None
    return model.moe_router_load_balancing_type, float(model.moe_aux_loss_coeff)


def mtp_scale(config) -> float:
    """The MTP loss scale per layer qvl's step applied (qvl.training.mtp), 0 where no MTP layer trained."""
    depths = mtp.mtp_depths(config.model)
    return config.model.mtp_loss_scaling_factor / depths if depths else 0.0


def mtp_note(config, spec: ParitySpec) -> list[str]:
    """Whether the multi-token-prediction head trained and was compared."""
    if mtp.mtp_depths(config.model):
        return [
            f"multi-token prediction: both sides trained the checkpoint's MTP head (scale "
            f"{config.model.mtp_loss_scaling_factor}); transformers builds none, so the reference is the published "
            "module (qvl.bridges.mtp_reference) on transformers' model; its losses, gradients and weights are compared."
        ]
    if not mtp_layers_of(spec.hf_path):
        return []
    return [
        "multi-token prediction: the checkpoint's MTP head was not trained on either side (mtp=false: the check "
        "trains it with full-model recipes and --loss-average token only)."
    ]


def mtp_layers_of(hf_path: Path) -> int:
    from qvl.bridges.mtp_reference import checkpoint_mtp_names, mtp_layer_count

    return mtp_layer_count(checkpoint_mtp_names(hf_path))


def reference_run(spec: ParitySpec, family, qvl, config):
    """transformers' side: the conversations qvl's loop consumed, unpacked, through the Trainer."""
    from transformers import AutoConfig, AutoTokenizer

    from qvl.training.parity.transformers_run import (
        pack_slots,
        reference_settings,
        run_transformers,
        samples_per_step,
    )

    settings = reference_settings(config, weight_decay_rule=spec.weight_decay_rule, loss_average=spec.loss_average)
    hf_config = AutoConfig.from_pretrained(str(spec.hf_path))
    tokenizer = AutoTokenizer.from_pretrained(str(spec.hf_path))
    steps = samples_per_step(qvl, hf_config, tokenizer, seconds_per_grid=family.video_positions_in_seconds)
    logger.info(
        "transformers: the same %d steps with its Trainer, %d conversations per step", spec.steps, len(steps[0])
    )
    output = Path(spec.run_dir) / "transformers"
    bf16 = spec.precision == "bf16"
    exact = exact_fp32_on(config)
    with fix_fla_tf32.arithmetic(exact):  # the reference computes as qvl's side did
        hf = run_transformers(
            spec.hf_path,
            steps,
            settings,
            output,
            bf16=bf16,
            adapters=qvl.adapters,
            mtp_scale=mtp_scale(config),
            moe_aux=moe_aux(config),
            slots=pack_slots(qvl),
        )
    return hf, settings


def exact_fp32_on(config) -> bool:
    """Whether qvl's run computed IEEE fp32 products on CUDA (qvl.exact_fp32), so the reference must too."""
    return bool(getattr(getattr(config, "qvl", None), "exact_fp32", False)) and torch.cuda.is_available()


def exact_fp32_note(config) -> list[str]:
    if not exact_fp32_on(config):
        return []
    return [
        "fp32 on CUDA: both sides computed fp32 products in IEEE fp32 (qvl.exact_fp32=true: TF32 off in torch's "
        "convolutions and in Triton's dots, flash-linear-attention's chunk solves included), so the fp32 tolerances "
        "hold there; training defaults leave TF32 where torch and Triton put it."
    ]


def run_notes(spec: ParitySpec, settings) -> list[str]:
    """What the check changed from the recipe to run both frameworks alike."""
    notes = []
    replicas = _data_parallel(spec.options)
    if replicas > 1:
        notes.append(
            f"data parallel: {replicas} replicas trained with plain DDP (use_distributed_optimizer=false), so that "
            "every rank holds step 1's whole reduced gradient to compare; the Adam update is the same."
        )
    if "warmup_iters" not in spec.options:
        notes.append(
            f"schedule: this check warmed up over {settings.warmup_steps} step(s) instead of the recipe's warm-up "
            "(pass warmup_iters=N, fewer than --steps, to choose); both frameworks followed the same learning rates."
        )
    return notes


def _data_parallel(options: dict) -> int:
    """Data-parallel replicas of this run: the processes over tensor x pipeline x context parallel sizes."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    model_parallel = 1
    for key in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
        model_parallel *= int(options.get(key, 1))
    return max(1, world // model_parallel)


def lean_cross_entropy(device: str) -> bool:
    """Whether qvl's training loop on `device` replaces Megatron-Core's native fused cross-entropy (patch group
    "speed-cross-entropy", as the switch decides: where neither Transformer Engine nor Apex is installed)."""
    return switch.is_on("speed-cross-entropy", switch.Target.of(device=device))


def cross_entropy_note(config, spec: ParitySpec, device: str) -> list[str]:
    """What Megatron-Core's native fused cross-entropy does to an fp32 step, where it runs, and whether it was on."""
    if spec.precision != "fp32" or lean_cross_entropy(device):
        return []  # qvl's fused cross-entropy keeps the logits' dtype: nothing deliberate
    fused = bool(config.model.cross_entropy_loss_fusion)
    state = (
        "it was on in this run, so every gradient may differ by bf16 rounding (2^-9 relative)"
        if fused
        else "this check turned it off (model.cross_entropy_loss_fusion=false) to compare the rest exactly; "
        "pass model.cross_entropy_loss_fusion=true to see its effect"
    )
    return [
        "cross-entropy: Megatron-Core's native fused cross-entropy (the recipe's default where Transformer Engine or "
        f"Apex is installed) rounds the logits' gradient to bf16 even in fp32 training; {state}."
    ]


def moe_note(config) -> list[str]:
    """The MoE load-balancing loss each framework adds, and what this run compared."""
    on = moe_aux(config)
    if on is None:
        return [
            "MoE load balancing: Megatron adds its auxiliary loss (the recipe's moe_aux_loss_coeff) over each pack's "
            "tokens; this check set model.moe_aux_loss_coeff=0 to compare the language-model loss alone (the "
            "reference adds Megatron's loss on one model replica, without data parallelism, with --loss-average "
            "token)."
        ]
    kind, coefficient = on
    return [
        f"MoE load balancing: both sides added Megatron-Core's {kind} (moe_aux_loss_coeff={coefficient:g}) over each "
        "pack's tokens and every MoE layer; the reference computes it on transformers' routers from each pack's "
        "expert counts (qvl.training.parity.moe_aux), since transformers' own router_aux_loss_coef loss is another "
        "definition (all layers pooled, per conversation). Under calculate_per_token_loss Megatron-Core weighs it by "
        "the pack's tokens over the step's learned tokens. The router gradients are compared with every tensor (with "
        "adapters, the adapters' gradients it steers), and each step's loss as the routers add it, coefficient "
        "included (each layer's, summed over layers and packs), so a coefficient off on either side fails."
    ]


def deliberate_differences(config, hf, settings) -> list[str]:
    """Conventions where Megatron-Bridge and transformers differ by design, and which one this run used."""
    notes = []
    extra = hf.decay_rules_differ
    if extra:
        used = "Megatron's (the recipe's)" if settings.weight_decay_rule == "megatron" else "transformers'"
        notes.append(
            f"weight decay: Megatron-Core skips every 1-D tensor and bias; transformers' Trainer skips biases, "
            f"nn.LayerNorm weights and names with a 'norm' word; the rules differ on {len(extra)} tensors "
            f"(e.g. {extra[0]}). This run's reference used {used} rule (--weight-decay-rule)."
        )
    ours = (
        "every learned token of the global batch weighs the same (calculate_per_token_loss=True)"
        if config.model.calculate_per_token_loss
        else "each pack is averaged over its own tokens, then the packs (calculate_per_token_loss=False)"
    )
    reference = (
        "the reference was given transformers' ForCausalLMLoss over the step's learned tokens (compute_loss_func)"
        if settings.loss_average == "token"
        else "the reference used the Trainer's default"
    )
    notes.append(
        f"loss averaging: qvl's recipe: {ours}. transformers 5.12's Qwen-VL classes set accepts_loss_kwargs=False, "
        "so a plain Trainer averages each conversation over its own learned tokens and then the conversations of a "
        f"step (short answers weigh more); {reference} (--loss-average)."
    )
    return notes
