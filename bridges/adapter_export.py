"""A PEFT run's adapters as a Hugging Face `peft` adapter, or folded into a full HF checkpoint, with proof.

`qvl convert export-adapter RUN_OR_CHECKPOINT [HF_BASE] OUT` builds the Megatron model from HF_BASE (by default the
run's `hf_path`) with qvl's provider fixes (TP=1, PP=1, fp32), wraps it with the run's adapters (its run_config.yaml
says which), loads their trained weights from the run's checkpoint, and writes:
- an adapter (`adapter_config.json` + `adapter_model.safetensors`) whose keys and `target_modules` name exactly the
  transformers model's adapted modules, `task_type` CAUSAL_LM and `base_model_name_or_path` naming HF_BASE (its hub
  id where its config has one, else its absolute path). Each adapter's B (and DoRA's magnitude) goes through the Megatron-Bridge
  mapping of the weight it adapts, so a fused Megatron projection comes out in the layout of the HF modules it maps
  to: q/k/v and gate/up split, Qwen3-VL's vision `qkv` and Qwen3.5's `in_proj_qkv` in transformers' order. A (the
  input side) is the same for every HF module a fused one maps to. Checkpoint names become the transformers model's
  module names through transformers' own conversion mapping (Qwen2.5-VL's `model.layers` ->
  `model.language_model.layers`), since `peft` matches live module names. MoE experts' adapters become peft's LoRA
  on transformers' fused 3-D expert parameters (`target_parameters`; qvl.bridges.adapter_experts).
- with `merged=True`, a full HF checkpoint with the adapters folded into their weights in Megatron's layout (W + s B A;
  DoRA's m (W + s B A) / ||W + s B A||), exported by Megatron-Bridge like any trained model.

The check (qvl.bridges.adapter_check) compares the written files, loaded by transformers + `peft` (with no missing or
unexpected key) or as the merged checkpoint, with the model the run trained, loaded from its checkpoint as training
resumes (qvl.bridges.trained), so a defect in this module's own load of the adapters fails it.

Megatron-Bridge's own `AutoBridge.export_adapter_ckpt` (0.6.2) builds the model without qvl's provider fixes, refuses
a run's `checkpoints/` folder, writes Qwen2/2.5-VL keys transformers 5 does not name, leaves Qwen3-VL's vision qkv in
Megatron's per-head order, drops adapters on the HF vision tower and collapses expert adapters; hence this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qvl.bridges.adapter_experts import FusedExpertFactors, expert_place, expert_tensors, is_expert_parameter
from qvl.bridges.checkpoints import check_megatron_checkpoint, checkpoints_of
from qvl.bridges.convert import auto_bridge_with_weights, copy_hf_side_files, require_qwen_vl
from qvl.bridges.providers import apply_provider_fixes
from qvl.foundation import patches
from qvl.foundation.errors import ConversionError
from qvl.foundation.families import family_of_architecture
from qvl.foundation.megatron import import_megatron_bridge
from qvl.kernels import speed_aligned_widths, torch_wgrad_accum

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Model dimensions a run's adapters depend on, compared between its run_config.yaml and HF_BASE.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")


@dataclass(kw_only=True, slots=True)
class AdapterRun:
    """A PEFT run's latest checkpoint and the run_config.yaml it was saved with."""

    path: Path  # what the user passed
    iteration: Path  # the iteration folder holding the adapters
    config: dict[str, Any]

    @property
    def checkpoints(self) -> Path:
        """The folder to load the run's model from as training resumes (the iteration, where that was passed)."""
        return self.iteration if self.iteration == Path(self.path) else self.iteration.parent

    @property
    def peft(self) -> dict[str, Any]:
        return self.config["peft"]

    @property
    def family(self) -> str:
        return self.peft["family"]


def find_adapter_run(path: Path) -> AdapterRun:
    """The PEFT checkpoint in `path` (a `qvl train` run directory, its checkpoints folder, or one iteration)."""
    import_megatron_bridge()
    from megatron.bridge.training.utils.checkpoint_utils import read_run_config

    path = Path(path)
    iteration = check_megatron_checkpoint(checkpoints_of(path), "RUN_OR_CHECKPOINT")
    config_file = iteration / "run_config.yaml"
    if not config_file.is_file():
        raise ConversionError(f"RUN_OR_CHECKPOINT={path}: {iteration.name} has no run_config.yaml; pass a PEFT run")
    config = read_run_config(str(config_file))
    if not config.get("peft"):
        raise ConversionError(
            f"RUN_OR_CHECKPOINT={path} is a full fine-tune or an imported model (its run_config.yaml has no peft "
            "section); export it with `qvl convert export`"
        )
    if not config["peft"].get("family"):
        raise ConversionError(
            f"RUN_OR_CHECKPOINT={path}: its adapters ({config['peft'].get('_target_')}) were not made by a qvl PEFT "
            "recipe, so which modules they adapt is unknown; train it with a qvl `*_peft` recipe"
        )
    return AdapterRun(path=path, iteration=iteration, config=config)


def hf_base_of(run: AdapterRun, hf_base: Path | str | None) -> Path:
    """HF_BASE, or where none is given the HF checkpoint the run was trained with (its `hf_path`, which
    run_config.yaml records as the provider's `hf_model_id`) when that is a local folder with weights."""
    if hf_base:
        return Path(hf_base)
    hf_path = run.config.get("model", {}).get("hf_model_id")
    if hf_path and Path(hf_path).is_dir() and any(Path(hf_path).glob("*.safetensors")):
        return Path(hf_path)
    raise ConversionError(
        f"RUN_OR_CHECKPOINT={run.path}: the run's hf_path={hf_path} is not a local HF checkpoint with weights, so "
        "the base the adapters apply to is unknown; pass HF_BASE, the HF checkpoint the run fine-tuned from"
    )


def base_model_name(hf_base: Path) -> str:
    """How adapter_config.json names its base: the hub id HF_BASE's config.json records (`_name_or_path`), else
    HF_BASE's absolute path (a relative one breaks as soon as the adapter is read from another folder)."""
    import json
    import re

    recorded = json.loads((Path(hf_base) / "config.json").read_text()).get("_name_or_path") or ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", recorded) and not Path(recorded).exists():
        return recorded
    return str(Path(hf_base).resolve())


def check_base_matches(run: AdapterRun, hf_base: Path) -> Any:
    """Refuse an HF_BASE of another family or other shapes than the run's model; returns HF_BASE's provider."""
    from qvl.bridges.providers import provider_from_hf

    architecture = require_qwen_vl(Path(hf_base))
    family = family_of_architecture(architecture)
    if family is None or family.name != run.family:
        raise ConversionError(
            f"HF_BASE={hf_base} is a {family.title if family else architecture} checkpoint, but the adapters in "
            f"{run.path} were trained on {run.family}; pass the HF checkpoint the run fine-tuned from"
        )
    provider = provider_from_hf(Path(hf_base))
    model = run.config.get("model", {})
    for name in _SHAPE_FIELDS:
        trained, base = model.get(name), getattr(provider, name, None)
        if trained is not None and base is not None and trained != base:
            raise ConversionError(
                f"HF_BASE={hf_base} has {name}={base}, but the adapters in {run.path} were trained on a model with "
                f"{name}={trained}; pass the HF checkpoint the run fine-tuned from"
            )
    return provider


def adapters_of(run: AdapterRun) -> Any:
    """qvl's LoRA / DoRA config the run was trained with (from its run_config.yaml)."""
    from dataclasses import fields

    from qvl.bridges.adapters import QvlDoRA, QvlLoRA

    kind = QvlDoRA if is_dora(run.peft) else QvlLoRA
    names = {f.name for f in fields(kind) if f.init}
    return kind(**{k: v for k, v in run.peft.items() if k in names and k != "params_to_save"})


def build_adapted_model(run: AdapterRun, hf_base: Path) -> tuple[Any, list[Any], Any]:
    """(bridge, model, adapters): HF_BASE's weights in qvl's Megatron model (TP=1, PP=1, fp32) with the run's trained
    adapters loaded. Needs an initialised single-rank distributed context."""
    check_base_matches(run, hf_base)
    bridge = auto_bridge_with_weights(Path(hf_base), torch.float32)
    hf_config = bridge.hf_pretrained.config
    provider = bridge.to_megatron_provider(load_weights=True)
    apply_provider_fixes(provider, hf_config)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = 1
    provider.sequence_parallel = False
    provider.params_dtype = provider.pipeline_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    provider.finalize()
    adapters = adapters_of(run)
    provider.register_pre_wrap_hook(lambda chunks: adapters(chunks, training=True))
    torch_wgrad_accum.provide_kernels()
    with patches.applied(speed_aligned_widths.GROUP):  # HF tower tensors padded to the aligned widths it is built with
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    adapters.set_params_to_save(model)
    load_adapter_weights(model, adapters, run)
    for chunk in model:
        chunk.eval()
    return bridge, model, adapters


def load_adapter_weights(model: list[Any], adapters: Any, run: AdapterRun) -> None:
    """The run's trained adapter tensors into `model`'s adapters (the base weights stay HF_BASE's)."""
    from megatron.bridge.training.checkpointing import apply_peft_adapter_filter_to_state_dict
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    state = apply_peft_adapter_filter_to_state_dict({"model": model[0].sharded_state_dict()}, adapters)
    try:
        loaded = dist_checkpointing.load(state, str(run.iteration))
    except (CheckpointingException, KeyError, RuntimeError, ValueError) as err:
        raise ConversionError(
            f"the adapters in {run.path} do not fit the model built from HF_BASE ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); pass the HF checkpoint the run fine-tuned from"
        ) from err
    result = model[0].load_state_dict(loaded["model"], strict=False)
    if result.unexpected_keys:
        raise ConversionError(f"{run.path}: adapter tensors the model has no place for: {result.unexpected_keys[:5]}")


# --- the adapter in peft's format ---


@dataclass(kw_only=True, slots=True)
class AdaptedLinear:
    """One adapted Megatron linear: its weight's name, the module mapped by the bridge, A, B and DoRA's magnitude."""

    weight_name: str  # the unwrapped Megatron parameter name, as the bridge's mapping registry knows it
    base: Any  # the Megatron (or HF tower) linear the mapping converts
    lora_a: torch.Tensor  # [rank, in]
    lora_b: torch.Tensor  # [out, rank]
    scale: float
    magnitude: torch.Tensor | None = None  # DoRA: [out]


def _weight(param: torch.Tensor) -> torch.Tensor:
    return param.detach()


def adapted_linears(model: list[Any], value: Callable[[torch.Tensor], torch.Tensor] = _weight) -> list[AdaptedLinear]:
    """Every adapted linear of a single-rank model with its adapter tensors, or what `value` reads from each
    adapter parameter (the parity check reads their gradients)."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.lora_layers import LinearAdapter

    found = []
    for name, module in model[0].named_modules():
        if isinstance(module, AdapterWrapper):
            adapter = module.adapter
            magnitude = getattr(adapter, "weight_magnitude", None)
            found.append(
                AdaptedLinear(
                    weight_name=f"{name}.weight",
                    base=module.to_wrap,
                    lora_a=value(adapter.linear_in.weight),
                    lora_b=value(adapter.linear_out.weight),
                    scale=adapter.alpha / adapter.dim,
                    magnitude=None if magnitude is None else value(magnitude),
                )
            )
        elif isinstance(module, LinearAdapter):
            found.append(
                AdaptedLinear(
                    weight_name=f"{name}.weight",
                    base=module,
                    lora_a=value(module.linear_in.weight),
                    lora_b=value(module.linear_out.weight),
                    scale=module.scale,
                )
            )
    return found


def rows_as_hf(mapping: Any, rows: torch.Tensor, base: Any) -> dict[str, torch.Tensor]:
    """`rows` ([out, k], rows laid out as the adapted weight's) in the layout of each HF tensor the weight maps to.

    The mapping of a weight reorders and splits its output rows (q/k/v, gate/up, per-head interleaving); it is given
    tensors of the weight's own shape, `k` columns at a time zero-padded, so it never sees an unusual shape."""
    width = base.weight.shape[1]
    pieces: dict[str, list[torch.Tensor]] = {}
    for start in range(0, rows.shape[1], width):
        chunk = rows[:, start : start + width]
        padded = torch.nn.functional.pad(chunk, (0, width - chunk.shape[1]))
        for hf_name, tensor in mapping.megatron_to_hf(padded, base).items():
            pieces.setdefault(hf_name, []).append(tensor[:, : chunk.shape[1]])
    return {hf_name: torch.cat(parts, dim=1) for hf_name, parts in pieces.items()}


def hf_module_names(hf_base: Path) -> tuple[Any, dict[str, tuple[int, int]], Any]:
    """(renamer, {live linear name: (out, in)}, meta model): the transformers model's linears, built on meta, and a
    function that turns a checkpoint tensor name into its live name (transformers' conversion mapping)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    config = AutoConfig.from_pretrained(str(hf_base))
    with torch.device("meta"):
        hf_model = AutoModelForImageTextToText.from_config(config)
    conversions = get_model_conversion_mapping(hf_model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = hf_model.state_dict()

    def live_name(checkpoint_name: str) -> str:
        return rename_source_key(checkpoint_name, renamings, converters, hf_model.base_model_prefix, meta_state)[0]

    linears = {
        n: (m.out_features, m.in_features) for n, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    return live_name, linears, hf_model


@dataclass(kw_only=True, slots=True)
class PeftState:
    """Adapter tensors under `peft`'s state-dict names, and what they adapt."""

    tensors: dict[str, torch.Tensor]
    modules: list[str]  # the live HF module names adapted
    parameters: list[str]  # the live names of the fused 3-D expert parameters adapted (peft's target_parameters)
    # lora_A names that are one Megatron A: the HF modules of one fused projection (q/k/v, gate/up) share it
    shared_a: list[list[str]]
    # each adapted Megatron module's HF modules and expert parameters (live names)
    sources: dict[str, list[str]] = field(default_factory=dict)


def peft_state(
    bridge: Any, model: list[Any], hf_base: Path, value: Callable[[torch.Tensor], torch.Tensor] = _weight
) -> PeftState:
    """The adapters of a single-rank model (or what `value` reads from their parameters) in peft's layout."""
    registry = bridge._model_bridge.mapping_registry()
    live_name, linears, hf_model = hf_module_names(hf_base)
    state = PeftState(tensors={}, modules=[], parameters=[], shared_a=[])
    experts: dict[str, FusedExpertFactors] = {}
    for linear in adapted_linears(model, value):
        mapping = registry.megatron_to_hf_lookup(linear.weight_name)
        if mapping is None:
            raise ConversionError(f"{linear.weight_name}: Megatron-Bridge has no mapping for the adapted weight")
        b_rows = rows_as_hf(mapping, linear.lora_b, linear.base)
        magnitudes = rows_as_hf(mapping, linear.magnitude[:, None], linear.base) if linear.magnitude is not None else {}
        shared = []
        for hf_name, lora_b in b_rows.items():
            live = live_name(hf_name)
            state.sources.setdefault(linear.weight_name.removesuffix(".weight"), []).append(
                live.removesuffix(".weight")
            )
            if is_expert_parameter(hf_model, live):
                place = expert_place(hf_name, linear.weight_name)
                experts.setdefault(live, FusedExpertFactors()).add(place, linear.lora_a, lora_b)
                continue
            module = live.removesuffix(".weight")
            if module not in linears:
                raise ConversionError(f"{linear.weight_name} maps to {hf_name}, which is no linear of HF_BASE's model")
            out_features, in_features = linears[module]
            prefix = f"base_model.model.{module}"
            # The replicated HF tower is built with aligned (padded) MLP widths: cut back to the HF module's.
            state.tensors[f"{prefix}.lora_A.weight"] = linear.lora_a[:, :in_features].contiguous()
            state.tensors[f"{prefix}.lora_B.weight"] = lora_b[:out_features].contiguous()
            if hf_name in magnitudes:
                state.tensors[f"{prefix}.lora_magnitude_vector"] = magnitudes[hf_name][:out_features, 0].contiguous()
            state.modules.append(module)
            shared.append(f"{prefix}.lora_A.weight")
        if len(shared) > 1:
            state.shared_a.append(shared)
    if experts:
        state.parameters = sorted(experts)
        config = lora_config(rank=1, alpha=1, dropout=0.0, dora=False, modules=[], parameters=state.parameters)
        state.tensors |= expert_tensors(experts, hf_model, config)
    return state


def lora_config(
    *, rank: int, alpha: int, dropout: float, dora: bool, modules: list[str], parameters: list[str] = (),
    base: str | None = None, task_type: str | None = None,
) -> Any:  # fmt: skip
    """peft's LoraConfig for qvl adapters of `rank` and `alpha` (LoRA, or DoRA) on the HF `modules` and fused expert
    `parameters`, naming the `base` model and `task_type`. peft's expert-parameter LoRA takes no dropout, so an
    adapter with experts is written without it (dropout acts in training only: the adapter's outputs are the same)."""
    from peft import LoraConfig

    if parameters and dropout:
        logger.info(
            "adapter_config.json: lora_dropout 0 instead of %s (peft's expert-parameter LoRA has none)", dropout
        )
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0 if parameters else dropout,
        target_modules=sorted(set(modules)),
        target_parameters=list(parameters) or None,
        use_dora=dora,
        bias="none",
        base_model_name_or_path=base,
        task_type=task_type,
    )


def is_dora(peft: dict[str, Any]) -> bool:
    """Whether a run_config.yaml `peft` section is qvl's DoRA."""
    return str(peft.get("_target_", "")).endswith("QvlDoRA")


# peft's task for a Qwen-VL generating text (PeftModelForCausalLM: generate() and the forward pass media through).
TASK_TYPE = "CAUSAL_LM"


def write_adapter(
    run: AdapterRun, bridge: Any, model: list[Any], hf_base: Path, out: Path, *, state: PeftState | None = None,
    base: str | None = None,
) -> Path:  # fmt: skip
    """Write OUT/adapter_config.json and OUT/adapter_model.safetensors (rank 0's model, TP=1, PP=1): the model's
    adapters, or `state` (a part of them) on `base` (default HF_BASE's name)."""
    from safetensors.torch import save_file

    state = state or peft_state(bridge, model, hf_base)
    if not state.modules and not state.parameters:
        raise ConversionError(f"{run.path} holds no adapted linear; nothing to export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(
        rank=int(run.peft["dim"]),
        alpha=int(run.peft["alpha"]),
        dropout=float(run.peft.get("dropout", 0.0)),
        dora=is_dora(run.peft),
        modules=state.modules,
        parameters=state.parameters,
        base=base or base_model_name(hf_base),
        task_type=TASK_TYPE,
    )
    config.save_pretrained(str(out))
    # A fused projection's HF modules share one A: each gets its own copy in the file.
    save_file({k: v.float().clone() for k, v in state.tensors.items()}, str(out / ADAPTER_WEIGHTS))
    logger.info(
        "wrote %d adapter tensors for %d HF modules and %d expert parameters to %s",
        len(state.tensors), len(state.modules), len(state.parameters), out,
    )  # fmt: skip
    return out


# --- the adapters folded into the weights ---


def merge_adapters(model: list[Any], fold: Callable[[str], bool] = lambda name: True) -> None:
    """Fold every adapter whose module name `fold` accepts into the weight it adapts, drop the others, and put the
    plain linear back in its place (in Megatron's layout, so Megatron-Bridge exports the result like any trained
    model)."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.lora_layers import LinearAdapter

    for chunk in model:
        for name, module in list(chunk.named_modules()):
            if not isinstance(module, (AdapterWrapper, LinearAdapter)):
                continue
            linear = adapted_linears([torch.nn.ModuleDict({"m": module})])[0]
            base = linear.base
            if fold(name):
                with torch.no_grad():
                    weight = base.weight + linear.scale * (linear.lora_b @ linear.lora_a).to(base.weight.dtype)
                    if linear.magnitude is not None:
                        weight = weight * (linear.magnitude / torch.linalg.norm(weight, dim=1))[:, None]
                    base.weight.copy_(weight)
            if isinstance(module, AdapterWrapper):
                parent_name, _, child = name.rpartition(".")
                setattr(chunk.get_submodule(parent_name) if parent_name else chunk, child, base)
            else:
                module.disable_adapter_layers()  # the HF tower's LinearAdapter keeps the weight's own name


def write_merged(
    bridge: Any, model: list[Any], hf_base: Path, out: Path, fold: Callable[[str], bool] = lambda name: True
) -> Path:
    """A full HF checkpoint at OUT with the adapters `fold` accepts folded in (consumes `model`'s adapters, dropping
    the others; qvl.bridges.adapter_vllm folds what vLLM does not serve): HF_BASE's config,
    tokenizer and processor files, the merged weights in HF_BASE's tensor layout (the weights-backed bridge's), and
    the tensors HF_BASE keeps aside from conversion (e.g. Qwen3.5's `mtp.*`) where the model did not export them."""
    import tempfile

    from qvl.bridges import unconverted

    merge_adapters(model, fold)
    speed_aligned_widths.mark_hf_widths(model, bridge.hf_pretrained.config)
    with patches.applied(speed_aligned_widths.GROUP):  # padded widths cut back to the checkpoint's
        bridge.save_hf_weights(model, str(out), show_progress=False, merge_adapter_weights=False)
    copy_hf_side_files(Path(hf_base), Path(out))
    with tempfile.TemporaryDirectory(prefix="qvl-merged-") as side:
        unconverted.save_unconverted(Path(hf_base), Path(side))
        unconverted.restore_unconverted(Path(side), Path(out))
    return Path(out)
