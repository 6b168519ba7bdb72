"""The one switch: which of qvl's patch groups (qvl.foundation.patches) a run uses, and why, decided from the run's
config and the machine it runs on.

The machine is the run's target, not necessarily this one: a plan made on a laptop for an H100 asks what the H100's
run applies (`Target.of(config, device="cuda")`). The training loop (qvl.training.loop.run_megatron_loop), the
planner, the parity check, the step census and `qvl doctor --patches` all ask `decide`, so "is qvl's cross-entropy
on?" has one answer.

Each group is applied where its scope says:
- "process": from the CPU runtime's activation for the rest of the process (qvl.foundation.runtime);
- "training": around every Megatron-Bridge training loop qvl runs (`applied_for_training`), undone after it;
- "model": by qvl's model classes and transforms while the part they patch is built or runs;
- "conversion": around qvl's HF <-> Megatron conversions (qvl.bridges.convert);
- "launch": around NeMo-Run's rendering and submission (qvl.launchers);
- "import": while qvl imports Megatron-Bridge (qvl.foundation.megatron.import_megatron_bridge).
A rule whose group has left the registry (its code became a method of qvl's own classes) is dropped.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from qvl.foundation import patch_entries, patches
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import family_of_provider
from qvl.foundation.megatron import gated_delta_net, have_transformer_engine

DEVICES = ("cpu", "cuda")
SCOPES = ("process", "training", "model", "conversion", "launch", "import")


@dataclass(kw_only=True, slots=True, frozen=True)
class Target:
    """What decides a run's patch groups: the device it runs on, the kernel packages installed there, and the model
    parts some groups stand in for (None where not known, e.g. `qvl doctor --patches` without a recipe)."""

    device: str  # "cpu" or "cuda"
    transformer_engine: bool = False
    apex: bool = False
    fla: bool = False  # flash-linear-attention (Gated DeltaNet's Triton kernels)
    hf_vision_tower: bool | None = None  # the replicated HF tower of Qwen2-VL / Qwen2.5-VL (else Megatron's)
    gated_delta_net: bool | None = None  # Qwen3.5's linear-attention layers
    mtp: bool | None = None  # multi-token-prediction layers trained
    peft: bool | None = None  # adapters (LoRA, DoRA)
    preference: bool | None = None  # a preference stage (DPO and its variants) of an MoE model
    moe: bool | None = None  # the model has MoE layers
    padded_moe: bool | None = None  # an MoE model whose packs are padded (pipeline, sequence parallelism, graphs)
    cuda_graphs: bool | None = None  # the run asks for its layers as CUDA graphs (recipe option cuda_graphs)
    grouped_experts: bool | None = None  # the run asks for grouped-GEMM experts (recipe option grouped_experts)
    async_save: bool | None = None  # checkpoints written by another process while training goes on
    exact_fp32: bool | None = None  # the run asks for IEEE fp32 products on CUDA (qvl.exact_fp32: a parity check)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not a run's device; use one of: {', '.join(DEVICES)}")

    @property
    def torch_stack(self) -> bool:
        """Neither TE nor Apex is installed: Megatron-Core's optimizer falls back to torch Adam and Python loops, and
        the step takes qvl's torch paths."""
        return not (self.transformer_engine or self.apex)

    @classmethod
    def of(cls, config=None, *, device: str | None = None) -> Target:
        """A run of `config` (a ConfigContainer; None: any model) on `device` (default: this process's) with the
        packages of this environment: a run launched from here installs the same stack."""
        model = getattr(config, "model", None)
        family = family_of_provider(model)
        known = model is not None
        cuda_graphs = bool(getattr(getattr(config, "qvl", None), "cuda_graphs", False))
        return cls(
            device=device or current_device(),
            transformer_engine=have_transformer_engine(),
            apex=importlib.util.find_spec("apex") is not None,
            fla=importlib.util.find_spec("fla") is not None,
            hf_vision_tower=(family is not None and not family.megatron_vision_tower) if known else None,
            gated_delta_net=gated_delta_net(model) if known else None,
            mtp=bool(getattr(model, "mtp_num_layers", None)) if known else None,
            peft=getattr(config, "peft", None) is not None if known else None,
            cuda_graphs=cuda_graphs if known else None,
            grouped_experts=bool(getattr(getattr(config, "qvl", None), "grouped_experts", False)) if known else None,
            async_save=bool(getattr(getattr(config, "checkpoint", None), "async_save", False)) if known else None,
            exact_fp32=bool(getattr(getattr(config, "qvl", None), "exact_fp32", False)) if known else None,
            moe=bool(getattr(model, "num_moe_experts", None)) if known else None,
            padded_moe=bool(getattr(model, "num_moe_experts", None)) and (packs_padded(model) or cuda_graphs)
            if known
            else None,
            preference=bool(getattr(getattr(config, "qvl", None), "preference", None))
            and bool(getattr(model, "num_moe_experts", None))
            if known
            else None,
        )


def packs_padded(model: Any) -> bool:
    """Whether a run of `model` (the language model's provider) pads its packs (qvl.training.step.padded_length):
    pipeline stages exchange buffers of one size, sequence parallelism splits a pack evenly over the TP ranks."""
    stages = getattr(model, "pipeline_model_parallel_size", 1) or 1
    tp = getattr(model, "tensor_model_parallel_size", 1) or 1
    return stages > 1 or (bool(getattr(model, "sequence_parallel", False)) and tp > 1)


def current_device() -> str:
    """This process's device: the CPU where qvl's CPU runtime is active or no CUDA device is seen."""
    import torch  # the switch itself stays light: `qvl`'s parser imports it

    from qvl.foundation import runtime

    return "cpu" if runtime.is_active() or not torch.cuda.is_available() else "cuda"


@dataclass(kw_only=True, slots=True, frozen=True)
class Rule:
    """When one group is on: `condition` in words, `on` as code (None: it depends on a model fact not known)."""

    group: str
    scope: str
    condition: str
    on: Callable[[Target], bool | None]


@dataclass(kw_only=True, slots=True, frozen=True)
class Decision:
    """One group for one target: its kind, where it is applied, whether it is on and why."""

    group: str
    kind: str
    scope: str
    condition: str
    on: bool | None  # None: on or off with the model (no recipe given)
    reason: str


def _both(fact: bool | None, rest: bool) -> bool | None:
    """`fact and rest`, unknown only where it matters."""
    return False if not rest or fact is False else (None if fact is None else True)


_NO_TE_APEX = "neither Transformer Engine nor Apex is installed (Megatron-Core falls back to torch Adam and loops)"
# qvl's torch paths for the step: where either is installed (a NeMo container) the run keeps that stack's own kernels
_TORCH_STACK = "neither Transformer Engine nor Apex is installed (with either, the run keeps that stack's own paths)"
RULES: tuple[Rule, ...] = (
    Rule(group="cpu-runtime", scope="process", condition="the run's device is the CPU",
         on=lambda t: t.device == "cpu"),
    Rule(group="cpu-training", scope="training", condition="the run's device is the CPU",
         on=lambda t: t.device == "cpu"),
    Rule(group="fix-megatron-setup", scope="training", condition="always", on=lambda t: True),
    Rule(group="fix-adam-resume", scope="training", condition=_NO_TE_APEX, on=lambda t: t.torch_stack),
    Rule(group="speed-optimizer", scope="training", condition=_NO_TE_APEX, on=lambda t: t.torch_stack),
    Rule(group="speed-small-grads", scope="training",
         condition="always (it changes only 1-D parameters' gradient hooks, and not where DDP overlaps its gradient "
                   "reduction with the backward)",
         on=lambda t: True),
    Rule(group="speed-rotary", scope="training", condition=_TORCH_STACK, on=lambda t: t.torch_stack),
    Rule(group="speed-sync-free", scope="training", condition=_TORCH_STACK, on=lambda t: t.torch_stack),
    Rule(group="speed-cross-entropy", scope="training", condition=_TORCH_STACK, on=lambda t: t.torch_stack),
    Rule(group="speed-jit-warmup", scope="training",
         condition="always (the warm-up still runs where the model uses a fusion it compiles)", on=lambda t: True),
    Rule(group="speed-sync-save", scope="training",
         condition="the run saves its checkpoints synchronously (checkpoint.async_save off, every recipe's default)",
         on=lambda t: None if t.async_save is None else not t.async_save),
    Rule(group="speed-cuda-graphs", scope="training",
         condition="the run asks for it (cuda_graphs=true) and neither Transformer Engine nor Apex is installed (the "
                   "layers then read nothing back to the host, qvl's whole-pack rotary among them, so they can be "
                   "captured; on the CPU through cpu-cuda-graphs). A MoE layer's attention, router and combine are "
                   "captured, its experts run eagerly (speed_cuda_graphs.moe_graphs), or its attention and its whole "
                   "MoE block on one expert rank with grouped_experts=true (moe_block_graphs); Qwen3.5's dense Gated "
                   "DeltaNet layers graph their MLP alone (local_specs.GraphedMLPLayer). "
                   "The layers stay eager where they cannot be captured: pipeline stages, full activation recompute, "
                   "selective recompute of layernorm, moe_act or moe (speed_cuda_graphs.eager_layers); the vision "
                   "tower is graphed with or without them, but under pipeline parallelism, DDP's overlapped reduction, "
                   "vision_balance or, Megatron-Bridge's tower, any recompute (speed_cuda_graphs.eager_tower)",
         on=lambda t: _both(t.cuda_graphs, t.torch_stack)),
    Rule(group="cpu-cuda-graphs", scope="training",
         condition="the run asks for CUDA graphs (cuda_graphs=true) and its device is the CPU: captures are recorded "
                   "and replayed as the ops they ran (a check of the graphed step, not a faster one)",
         on=lambda t: _both(t.cuda_graphs, t.device == "cpu")),
    Rule(group="speed-grouped-experts", scope="training",
         condition="the run asks for it (grouped_experts=true), the model has MoE layers and Transformer Engine is not "
                   "installed (an MoE layer's experts are then Megatron-Core's SequentialMLP; it changes only those)",
         on=lambda t: _both(t.moe, bool(t.grouped_experts) and not t.transformer_engine)),
    Rule(group="speed-moe-one-rank-dispatch", scope="training",
         condition="the model has MoE layers (it changes only the all-to-all dispatcher on one expert-parallel and "
                   "one expert-TP rank: its identity sort, and its token counts kept on the device where dropless)",
         on=lambda t: t.moe),
    # read when a model's layers are built and its config validated (before the loop): applied from the first
    # provider qvl fixes for the rest of the process (qvl.kernels.torch_wgrad_accum.provide_kernels)
    Rule(group="torch-wgrad-accum", scope="training", condition="Apex is not installed",
         on=lambda t: not t.apex),
    # applied from the first provider qvl fixes without TE, for the rest of the process (qvl.bridges.fixes)
    Rule(group="torch-sequence-parallel-norm", scope="model", condition="Transformer Engine is not installed",
         on=lambda t: not t.transformer_engine),
    Rule(group="torch-checkpoint-without-output", scope="model", condition="Transformer Engine is not installed",
         on=lambda t: not t.transformer_engine),
    # also applied when a model is built outside a training loop, for the rest of that process
    Rule(group="speed-hf-vision", scope="training",
         condition="the model has a replicated HF vision tower (Qwen2-VL, Qwen2.5-VL)",
         on=lambda t: t.hf_vision_tower),
    Rule(group="torch-qwen3-vl-vision", scope="model",
         condition="the model has Megatron-Bridge's Qwen3-VL vision tower and Transformer Engine is not installed",
         on=lambda t: _both(None if t.hf_vision_tower is None else not t.hf_vision_tower, not t.transformer_engine)),
    Rule(group="torch-gated-delta", scope="model",
         condition="the model has Gated DeltaNet layers and flash-linear-attention cannot run (no CUDA or no fla)",
         on=lambda t: _both(t.gated_delta_net, not (t.device == "cuda" and t.fla))),
    Rule(group="speed-gated-delta-sync-free", scope="training",
         condition="the model has Gated DeltaNet layers (it changes only their checks of a pack's bounds and the "
                   "chunk list flash-linear-attention's kernels are given: both from the host values the step gives)",
         on=lambda t: t.gated_delta_net),
    Rule(group="speed-gated-delta-l2norm", scope="training",
         condition="the model has Gated DeltaNet layers and runs flash-linear-attention's kernels (CUDA with fla; it "
                   "changes only the l2norm inside Megatron-Core's compiled input preparation, which fla's breaks)",
         on=lambda t: _both(t.gated_delta_net, t.device == "cuda" and t.fla)),
    Rule(group="fix-fla-tf32", scope="training",
         condition="the run asks for exact fp32 (qvl.exact_fp32, as `qvl verify-training --precision fp32` on CUDA "
                   "does), has Gated DeltaNet layers and runs flash-linear-attention's kernels (CUDA with fla)",
         on=lambda t: _both(t.gated_delta_net, bool(t.exact_fp32) and t.device == "cuda" and t.fla)),
    Rule(group="fix-mtp-loss", scope="model", condition="the model trains multi-token-prediction layers",
         on=lambda t: t.mtp),
    Rule(group="fix-preference-moe-aux", scope="model",
         condition="a preference stage (DPO) trains an MoE model: its loss counts pairs, not tokens",
         on=lambda t: t.preference),
    Rule(group="fix-moe-pad-tokens", scope="training",
         condition="the model has MoE layers and its packs are padded: to seq_length under pipeline parallelism or "
                   "CUDA graphs (cuda_graphs=true), to a multiple of the TP size under sequence parallelism (the router "
                   "leaves the pad out of its balancing statistics)",
         on=lambda t: t.padded_moe),
    Rule(group="fix-qwen3-vl-deepstack-sp", scope="training",
         condition="the model has Megatron-Bridge's Qwen3-VL vision tower (its deepstack features are split over the "
                   "tensor-parallel ranks under sequence parallelism)",
         on=lambda t: None if t.hf_vision_tower is None else not t.hf_vision_tower),
    Rule(group="fix-expert-adapter-tp", scope="training",
         condition="the run trains adapters (it changes only adapters on MoE experts that expert_tensor_parallel_size "
                   "> 1 splits over ranks)",
         on=lambda t: t.peft),
    Rule(group="fix-empty-optimizer", scope="training",
         condition="the run trains adapters (it changes only an optimizer chain with a member that trains nothing on "
                   "any rank: adapters on MoE experts alone)",
         on=lambda t: t.peft),
    Rule(group="fix-peft-without-te", scope="model",
         condition="the run trains adapters (LoRA, DoRA) and Transformer Engine is not installed",
         on=lambda t: _both(t.peft, not t.transformer_engine)),
    Rule(group="speed-aligned-widths", scope="conversion",
         condition="always (it changes only a replicated HF tower's padded MLP widths)", on=lambda t: True),
    Rule(group="speed-import", scope="import",
         condition="always (it changes only when a function decorated while Megatron-Bridge imports is compiled)",
         on=lambda t: True),
    Rule(group="fix-kubeflow-v2.2", scope="launch",
         condition="always (it rewrites only a TrainJob whose spec asks for Kubeflow Trainer v2.2's runtimePatches)",
         on=lambda t: True),
)  # fmt: skip


def rules() -> tuple[Rule, ...]:
    """The rules of the groups in the registry, in the registry's order."""
    by_group = {rule.group: rule for rule in RULES}
    return tuple(by_group[group] for group in patches.GROUPS if group in by_group)


def decide(target: Target) -> tuple[Decision, ...]:
    """Every group of the registry for `target`: on or off, and why."""
    decisions = []
    for rule in rules():
        on = rule.on(target)
        state = {True: "on", False: "off", None: "on or off with the model"}[on]
        decisions.append(
            Decision(
                group=rule.group,
                kind=patch_entries.kind_of(rule.group),
                scope=rule.scope,
                condition=rule.condition,
                on=on,
                reason=f"{state} on {target.device}: {rule.condition}",
            )
        )
    return tuple(decisions)


def is_on(group: str, target: Target) -> bool:
    """Whether `target`'s run uses `group` (False where the registry no longer has it)."""
    return any(d.group == group and d.on for d in decide(target))


def training_groups(target: Target) -> tuple[str, ...]:
    """The groups applied around `target`'s training loop."""
    return tuple(d.group for d in decide(target) if d.scope == "training" and d.on)


@contextlib.contextmanager
def applied_for_training(target: Target) -> Iterator[None]:
    """`training_groups(target)` applied for a block (a training loop), each undone after it unless it was applied
    before (a model built earlier in the process keeps what its build applied); with them, where the run asks for
    exact fp32 on CUDA, IEEE fp32 products in torch and Triton (qvl.kernels.fix_fla_tf32)."""
    from qvl.kernels import fix_fla_tf32

    with fix_fla_tf32.arithmetic(bool(target.exact_fp32) and target.device == "cuda"):
        with patches.applied(*training_groups(target)):
            yield
