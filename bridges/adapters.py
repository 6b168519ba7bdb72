"""LoRA and DoRA adapters on qvl's Megatron models, through Megatron-Bridge's PEFT, with or without Transformer Engine.

A PEFT recipe names what to adapt by meaning (`qvl.foundation.families.ADAPTER_TARGETS`: the language model's linears
by default; the vision tower, the merger, the routed MoE experts); the family record says which Megatron modules each
meaning is, and `adapter_config` turns that into Megatron-Bridge's `LoRA` / `DoRA` with those modules as its
`target_modules`. qvl's subclasses add three things upstream lacks:
- the transform runs with Megatron-Bridge's TE flags corrected where TE is absent (qvl.kernels.fix_peft_without_te);
- a target that matches no module of the model is an error naming the target (upstream only warns);
- DoRA leaves a linear's own bias out of the magnitude scaling, as the DoRA paper and `peft` do (upstream scales the
  bias of a linear that adds it itself, e.g. Qwen2's fused qkv), and keeps a 2-D output 2-D (the vision merger's).
"""

# ruff: noqa: E402  (Megatron-Bridge must be imported through import_megatron_bridge first, as in qwen3_vl.py)
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any

from qvl.foundation.errors import ConfigError
from qvl.foundation.families import ADAPTER_TARGETS, get_family
from qvl.foundation.megatron import import_megatron_bridge
from qvl.kernels import fix_peft_without_te

import_megatron_bridge()

import torch
from megatron.bridge.peft.dora import DoRA
from megatron.bridge.peft.dora_layers import DoRALinear
from megatron.bridge.peft.lora import LoRA
from megatron.bridge.peft.utils import wildcard_match

logger = logging.getLogger(__name__)

METHODS = ("lora", "dora")


def target_modules(family: str, targets: tuple[str, ...] | list[str]) -> list[str]:
    """The Megatron module wildcards that adapter `targets` (meanings) stand for in `family`'s models."""
    record = get_family(family)
    if not targets:
        raise ConfigError(f"adapter_targets is empty; name at least one of {', '.join(ADAPTER_TARGETS)}")
    modules: list[str] = []
    for target in targets:
        if target not in ADAPTER_TARGETS:
            raise ConfigError(
                f"adapter_targets: {target!r} is not an adapter target; use any of {', '.join(ADAPTER_TARGETS)} "
                "(e.g. adapter_targets=language,vision)"
            )
        if not record.adapter_modules[target]:
            raise ConfigError(
                f"adapter_targets: {record.title} has no {target} to adapt (no such modules in its models); "
                f"drop {target} from adapter_targets"
            )
        modules += record.adapter_modules[target]
    return modules


def adapter_config(
    *,
    family: str,
    method: str = "lora",
    targets: tuple[str, ...] = ("language",),
    rank: int = 32,
    alpha: int = 32,
    dropout: float = 0.0,
    seed: int = 0,
) -> LoRA:
    """Megatron-Bridge's PEFT config (qvl's LoRA or DoRA) adapting `targets` of a `family` model."""
    if method not in METHODS:
        raise ConfigError(f"adapter={method!r} is not an adapter method; use one of {', '.join(METHODS)}")
    if rank < 1 or alpha < 1:
        raise ConfigError(f"adapter_rank={rank} and adapter_alpha={alpha} must be at least 1 (e.g. adapter_rank=16)")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"adapter_dropout={dropout} is a probability; use a value in [0, 1), e.g. 0.05")
    record = get_family(family)
    if method == "dora":
        _check_dora_targets(record, targets)
    kind = QvlDoRA if method == "dora" else QvlLoRA
    return kind(
        family=family,
        targets=list(targets),
        target_modules=target_modules(family, targets),
        dim=rank,
        alpha=alpha,
        dropout=dropout,
        init_seed=seed,
    )


def _check_dora_targets(record: Any, targets: tuple[str, ...]) -> None:
    # Megatron-Bridge's DoRA wraps Megatron-Core parallel linears only: the HF tower's nn.Linear fails in
    # get_adapter_attributes_from_linear, and experts take no expert-parallel groups there.
    hf_parts = [t for t in targets if t in ("vision", "merger") and not record.megatron_vision_tower]
    if hf_parts:
        raise ConfigError(
            f"adapter=dora cannot adapt {record.title}'s {' and '.join(hf_parts)} (its vision tower is the HF module, "
            "which Megatron-Bridge's DoRA does not wrap); use adapter=lora or drop them from adapter_targets"
        )
    if "experts" in targets:
        raise ConfigError(
            "adapter=dora cannot adapt MoE experts (Megatron-Bridge's DoRA has no expert-parallel adapters); use "
            "adapter=lora or drop experts from adapter_targets"
        )


def check_dora_layout(method: str, tensor_parallel: int) -> None:
    """Refuse DoRA at TP > 1: Megatron-Bridge's weight norm of a row-parallel linear covers one rank's columns."""
    if method == "dora" and tensor_parallel > 1:
        raise ConfigError(
            f"adapter=dora needs tensor_parallel=1 (got {tensor_parallel}): Megatron-Bridge's DoRA takes the norm "
            "of a row-parallel weight over one rank's columns only; use tensor_parallel=1 or adapter=lora"
        )


class _QvlAdapters:
    """What qvl's LoRA and DoRA add to Megatron-Bridge's: the TE-flag fix and targets that must match."""

    family: str
    targets: list[str]
    target_modules: list[str]
    lora_A_init_method: str
    init_seed: int

    def __call__(self, model: Any, training: bool = True) -> Any:
        self._check_targets_match(model)
        with fix_peft_without_te.without_te():
            model = super().__call__(model, training=training)  # type: ignore[misc]
        if self.lora_A_init_method == "xavier":
            for chunk in model if isinstance(model, list) else [model]:
                initialize_independent_of_layout(chunk, self.init_seed)
        return model

    def _check_targets_match(self, model: Any) -> None:
        from megatron.core import parallel_state

        if not self.family or parallel_state.get_pipeline_model_parallel_world_size() > 1:
            return  # a pipeline stage holds only some of the model's parts
        chunks = model if isinstance(model, list) else [model]
        names = [name for chunk in chunks for name, _ in chunk.named_modules()]
        patterns = get_family(self.family).adapter_modules
        for target in self.targets:
            if not any(wildcard_match(p, name) for p in patterns.get(target, ()) for name in names):
                raise ConfigError(
                    f"adapter_targets: {target!r} matches no module of this {get_family(self.family).title} model "
                    f"(looked for {', '.join(patterns.get(target, ())) or 'nothing'}); drop it from adapter_targets"
                )


@dataclass
class QvlLoRA(_QvlAdapters, LoRA):
    """Megatron-Bridge's LoRA on the family's `targets`, applicable without Transformer Engine."""

    family: str = ""
    targets: list[str] = field(default_factory=lambda: ["language"])
    init_seed: int = 0  # seeds each adapter's A by its name: the same initial adapters at every layout


@dataclass
class QvlDoRA(_QvlAdapters, DoRA):
    """Megatron-Bridge's DoRA on the family's `targets`, without TE, with the linear's bias outside the scaling."""

    family: str = ""
    targets: list[str] = field(default_factory=lambda: ["language"])
    init_seed: int = 0  # seeds each adapter's A by its name: the same initial adapters at every layout

    def transform(self, module: Any, name: str | None = None, prefix: str | None = None) -> Any:
        wrapped = super().transform(module, name, prefix)
        if type(wrapped) is DoRALinear:  # upstream's class: the same modules in qvl's class
            wrapped.__class__ = BiasOutsideDoRALinear
        return wrapped


class BiasOutsideDoRALinear(DoRALinear):
    """DoRA whose magnitude scales W x + s B A x only: m / ||W + s B A|| (W x + s B A x) + b, at any input rank.

    Megatron-Core linears that add their bias themselves (`skip_bias_add=False`, e.g. the fused qkv of Qwen2's
    attention) return W x + b, and upstream's DoRALinear (dora_layers.py, forward) scales that bias too, and adds it
    once more to its dropout correction; `peft` and the DoRA paper leave the bias alone. Upstream also shapes the
    scale `.view(1, 1, -1)`, which makes a 2-D output 3-D (the vision merger's [patches, hidden] became
    [1, patches, hidden]); the scale stays 1-D here and broadcasts over the output's last dim whatever its rank."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear_output, bias, layernorm_output = self.base_linear_forward(x)
        if not self._adapter_enabled:
            return linear_output, bias
        added = self._added_bias()
        own_bias = 0.0 if added is None else added
        adapter_output = self.adapter(layernorm_output.contiguous())
        scale = self.adapter.get_weight_magnitude() / self._get_weight_norm()  # [out]
        output = scale * (linear_output - own_bias + adapter_output) + own_bias
        if self.training and not isinstance(self.adapter.dropout, torch.nn.Identity):
            dropped = self.adapter.dropout(layernorm_output) - layernorm_output
            output = output + (scale - 1) * (self.base_linear_forward(dropped)[0] - own_bias)
        return output, bias

    def _added_bias(self) -> torch.Tensor | None:
        """The bias the wrapped linear adds into its output itself, or None (no bias, or returned apart)."""
        if getattr(self.to_wrap, "skip_bias_add", True):
            return None
        return getattr(self.to_wrap, "bias", None)


def initialize_independent_of_layout(chunk: torch.nn.Module, seed: int) -> None:
    """Each adapter's A drawn again from a generator seeded by (seed, its global module name), full size, and this
    rank's shard kept, so every TP / PP / EP layout and data-parallel replica starts from the same adapters.

    Megatron-Bridge draws A from the process's RNG as each adapter is built: its values depend on how many layers the
    pipeline stage holds and, with GPU initialisation, on the tensor-parallel shard's shape (xavier's fan-in/out), so
    LoRA at TP=2 or PP=2 started from other adapters than at TP=1 and its losses could not be compared."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.lora_layers import LinearAdapter

    for name, module in chunk.named_modules():
        if isinstance(module, AdapterWrapper):  # Megatron linears: xavier_normal_ (ParallelLinearAdapter's)
            weight, draw, group = module.adapter.linear_in.weight, torch.nn.init.xavier_normal_, module.adapter.tp_group
        elif isinstance(module, LinearAdapter):  # the replicated HF tower's: xavier_uniform_ (LinearAdapter's)
            weight, draw, group = module.linear_in.weight, torch.nn.init.xavier_uniform_, None
        else:
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{global_name(chunk, name)}".encode()))
        split = getattr(weight, "partition_dim", -1) if getattr(weight, "tensor_model_parallel", False) else -1
        ranks = torch.distributed.get_world_size(group) if group is not None and split >= 0 else 1
        shape = [*weight.shape]
        if ranks > 1:
            shape[split] *= ranks
        full = draw(torch.empty(shape, dtype=torch.float32), generator=generator)
        if ranks > 1:
            full = full.chunk(ranks, dim=split)[torch.distributed.get_rank(group)]
        with torch.no_grad():
            weight.copy_(full)


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """`name` with this stage's layer indices and this EP rank's expert indices made global (the same module has
    the same name at every layout)."""
    parts = name.split(".")  # the local path: every module is looked up by it
    renamed = list(parts)
    for k in range(1, len(parts)):
        if not parts[k].isdigit():
            continue
        owner = chunk.get_submodule(".".join(parts[: k + 1]))
        if parts[k - 1] == "layers" and isinstance(getattr(owner, "layer_number", None), int):
            renamed[k] = str(owner.layer_number - 1)  # Megatron-Core's layer_number is global and 1-based
        elif parts[k - 1] == "local_experts":
            experts = chunk.get_submodule(".".join(parts[: k - 1]))
            ep_group, local = getattr(experts, "ep_group", None), getattr(experts, "num_local_experts", None)
            if ep_group is not None and local:
                renamed[k] = str(ep_group.rank() * local + int(parts[k]))
    return ".".join(renamed)


def trainable_parameters(model: list[Any]) -> int:
    """Parameters that train (adapters, and whatever the recipe left unfrozen) in this rank's model chunks."""
    return sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)
