"""The one parallel-layout check: a TP/PP/CP/EP/VPP layout against a model's shape and a world size.

Recipes, the planner, checkpoint conversion and launch all ask this module, so a layout is refused the same
way everywhere, naming the model constraint that fails (attention heads, KV heads, layers, experts, vision
heads) and the values that satisfy all of them and the world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qvl.foundation.errors import ConfigError


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelFacts:
    """What a parallel layout must divide; `vision_heads` only where the vision tower is split over TP."""

    attention_heads: int
    kv_heads: int
    layers: int
    experts: int | None = None
    vision_heads: int | None = None
    name: str = "the model"


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelLayout:
    """Model-parallel sizes; data parallel fills the rest of the world."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    virtual_pipeline: int | None = None

    @property
    def model_parallel(self) -> int:
        """Ranks one dense replica spans: TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def expert_model_parallel(self) -> int:
        """Ranks one expert replica spans: TP x PP x EP (expert TP defaults to TP in Megatron)."""
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel

    @property
    def ranks(self) -> int:
        """The world size must be a multiple of this."""
        return math.lcm(self.model_parallel, self.expert_model_parallel)

    def describe(self) -> str:
        """`tensor_parallel=4 x pipeline_parallel=2` (the sizes above 1)."""
        names = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")
        used = [n for n in names if getattr(self, n) > 1] or ["tensor_parallel"]
        return " x ".join(f"{n}={getattr(self, n)}" for n in used)


def check_layout(
    model: ModelFacts, layout: ParallelLayout, *, world_size: int | None = None, even_pipeline: bool = False
) -> None:
    """Raise ConfigError naming the first model constraint `layout` breaks and the values that satisfy all.

    `even_pipeline`: PP must divide the layers (a checkpoint layout); recipes split layers unevenly instead.
    `world_size`: also check that the world holds whole model replicas.
    """
    check_model_layout(model, layout, world_size=world_size, even_pipeline=even_pipeline)
    if world_size is not None and world_size % layout.ranks:
        raise ConfigError(
            f"world size {world_size} is not divisible by {layout.describe()} = {layout.ranks}; "
            f"{_world_fix(model, layout, world_size, even_pipeline)}"
        )


def check_model_layout(
    model: ModelFacts, layout: ParallelLayout, *, world_size: int | None = None, even_pipeline: bool = False
) -> None:
    """The model's constraints only (heads, KV heads, layers, experts); fixes also fit `world_size` if given."""
    for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
        value = getattr(layout, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    for key, failure in (
        ("tensor_parallel", _tensor_failure(model, layout.tensor_parallel)),
        ("pipeline_parallel", _pipeline_failure(model, layout, even_pipeline)),
        ("expert_parallel", _expert_failure(model, layout.expert_parallel)),
    ):
        if failure:
            raise ConfigError(f"{failure}; {_fix(model, layout, key, world_size, even_pipeline)}")


def _tensor_failure(model: ModelFacts, tp: int) -> str:
    for count, what in (
        (model.attention_heads, "attention heads"),
        (model.kv_heads, "KV heads (query groups)"),
        (model.vision_heads, "vision attention heads"),
    ):
        if count is not None and count % tp:
            return (
                f"tensor_parallel={tp} does not divide {model.name}'s {count} {what} "
                f"({_shape(model)}; each TP rank holds whole heads)"
            )
    return ""


def _pipeline_failure(model: ModelFacts, layout: ParallelLayout, even: bool) -> str:
    pp, vpp = layout.pipeline_parallel, layout.virtual_pipeline
    if vpp is not None and pp < 2:
        return f"virtual_pipeline={vpp} needs pipeline_parallel >= 2 (got {pp})"
    chunks = pp * (vpp or 1)
    if chunks > model.layers:
        return f"pipeline_parallel={pp}{_vpp(vpp)} gives {chunks} stages for {model.name}'s {model.layers} layers"
    if even and model.layers % chunks:
        return f"pipeline_parallel={pp}{_vpp(vpp)} does not divide {model.name}'s {model.layers} layers"
    return ""


def _expert_failure(model: ModelFacts, ep: int) -> str:
    if ep == 1:
        return ""
    if not model.experts:
        return f"expert_parallel={ep} needs a mixture-of-experts model; {model.name} is dense"
    if model.experts % ep:
        return f"expert_parallel={ep} does not divide {model.name}'s {model.experts} experts"
    return ""


def valid_values(
    model: ModelFacts, layout: ParallelLayout, key: str, *, world_size: int | None = None, even_pipeline: bool = False
) -> list[int]:
    """Values of `key` that, with the rest of `layout`, satisfy every model constraint and the world size."""
    limit = {
        "tensor_parallel": model.attention_heads,
        "pipeline_parallel": model.layers,
        "expert_parallel": model.experts or 1,
        "context_parallel": world_size or 16,
    }[key]
    out = []
    for value in range(1, limit + 1):
        trial = _replace(layout, key, value)
        if any(
            (
                _tensor_failure(model, trial.tensor_parallel),
                _pipeline_failure(model, trial, even_pipeline),
                _expert_failure(model, trial.expert_parallel),
            )
        ):
            continue
        if world_size is not None and (world_size % trial.ranks):
            continue
        out.append(value)
    return out


def _fix(model: ModelFacts, layout: ParallelLayout, key: str, world: int | None, even: bool) -> str:
    values = valid_values(model, layout, key, world_size=world, even_pipeline=even)
    if key == "pipeline_parallel" and layout.virtual_pipeline is not None and layout.pipeline_parallel < 2:
        return "drop virtual_pipeline or set pipeline_parallel >= 2"
    if not values:
        return f"no {key} fits {_shape(model)}" + (f" on {world} ranks" if world else "") + "; change the layout"
    where = f" (on {world} ranks)" if world else ""
    return f"use {key}={_or(values)}{where}"


def _world_fix(model: ModelFacts, layout: ParallelLayout, world: int, even: bool) -> str:
    options = world_fixes(model, layout, world, even_pipeline=even)
    return ("use " + " or ".join(options)) if options else f"use a world size that is a multiple of {layout.ranks}"


def world_fixes(model: ModelFacts, layout: ParallelLayout, world: int, *, even_pipeline: bool = False) -> list[str]:
    """One-change layouts that fit `world` ranks and the model: `tensor_parallel=1, 2 or 4`, ..."""
    options = []
    for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
        if key == "expert_parallel" and not model.experts:
            continue
        values = valid_values(model, layout, key, world_size=world, even_pipeline=even_pipeline)
        if values and getattr(layout, key) not in values:
            options.append(f"{key}={_or(values)}")
    return options


def _replace(layout: ParallelLayout, key: str, value: int) -> ParallelLayout:
    fields = {k: getattr(layout, k) for k in ParallelLayout.__slots__}
    return ParallelLayout(**(fields | {key: value}))


def _shape(model: ModelFacts) -> str:
    parts = [f"{model.attention_heads} attention heads", f"{model.kv_heads} KV heads", f"{model.layers} layers"]
    if model.experts:
        parts.append(f"{model.experts} experts")
    if model.vision_heads:
        parts.append(f"{model.vision_heads} vision heads")
    return ", ".join(parts)


def _vpp(vpp: int | None) -> str:
    return f" x virtual_pipeline={vpp}" if vpp else ""


def _or(values: list[int]) -> str:
    shown = [str(v) for v in values[:8]] + (["..."] if len(values) > 8 else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
