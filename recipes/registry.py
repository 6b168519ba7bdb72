"""The recipe registry: every recipe function, looked up by name from the CLI, NeMo-Run and the planner.

A recipe is a function of keyword arguments returning a Megatron-Bridge `ConfigContainer`. Family
modules register theirs with `@recipe(family=..., size=..., stage=...)`; the registry imports the family
modules on first lookup, so `qvl recipes` sees them all without importing Megatron at CLI start-up.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES
from qvl.recipes.options import did_you_mean

# Modules that define recipes (each family record names its own); imported lazily by `all_recipes()`.
RECIPE_MODULES: tuple[str, ...] = tuple(dict.fromkeys(f.recipe_module for f in FAMILIES.values()))

log = logging.getLogger(__name__)

STAGES = ("pretrain", "sft", "peft", "dpo", "dpo_peft")
ADAPTER_STAGES = ("peft", "dpo_peft")  # the stages that train adapters (LoRA, DoRA) on a frozen model
PREFERENCE_STAGES = ("dpo", "dpo_peft")  # the stages that train on preference pairs (qvl.recipes.preference)


@dataclass(kw_only=True, slots=True, frozen=True)
class RecipeInfo:
    """One registered recipe: its name, what it trains, and its default parallel layout."""

    name: str
    family: str
    size: str
    stage: str
    fn: Callable[..., Any]
    layout: dict[str, int] = field(default_factory=dict)  # tensor_parallel, pipeline_parallel, ... (1 where absent)
    gpus: int | None = None  # the GPU count the layout was planned for (None: not planned)
    summary: str = ""


_RECIPES: dict[str, RecipeInfo] = {}


def recipe(*, family: str, size: str, stage: str, name: str | None = None, gpus: int | None = None, **layout: int):
    """Register a recipe function under `name` (default: the function's name), with its default parallel layout and
    the GPU count that layout was planned for."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        if key in _RECIPES and _RECIPES[key].fn is not fn:
            raise ValueError(f"recipe {key!r} is registered twice ({_RECIPES[key].fn.__module__} and {fn.__module__})")
        doc = (fn.__doc__ or "").strip().splitlines()
        _RECIPES[key] = RecipeInfo(
            name=key,
            family=family,
            size=size,
            stage=stage,
            fn=fn,
            layout=dict(layout),
            gpus=gpus,
            summary=doc[0] if doc else "",
        )
        return fn

    return decorate


def all_recipes() -> list[RecipeInfo]:
    """Every registered recipe, sorted by family, size and stage."""
    for module in RECIPE_MODULES:
        importlib.import_module(module)
    return sorted(_RECIPES.values(), key=lambda r: (r.family, size_key(r.size), STAGES.index(r.stage), r.name))


def size_key(size: str) -> tuple:
    """Natural order of sizes: 3b before 7b before 32b, 30b-a3b by its total size."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", size))


# Recipe names spell the family as its record does (qwen2_5_vl_3b_sft); names written before that (qwen25_vl_3b_sft,
# qwen35_vl_9b_sft, qwen36_vl_*, qwen38_vl_*) keep working, with a note naming the current spelling.
_OLD_SPELLING = re.compile(r"^qwen(\d)(\d)_vl_")


def current_name(name: str) -> str:
    """`name` in the current spelling: `qwen25_vl_3b_sft` -> `qwen2_5_vl_3b_sft`; other names unchanged."""
    return _OLD_SPELLING.sub(r"qwen\1_\2_vl_", name)


def old_name(name: str) -> str | None:
    """The spelling `name` had before (`qwen2_5_vl_3b_sft` -> `qwen25_vl_3b_sft`), or None if it had no other."""
    old = re.sub(r"^qwen(\d)_(\d)_vl_", r"qwen\1\2_vl_", name)
    return old if old != name else None


def get_recipe(name: str) -> RecipeInfo:
    """The recipe called `name` (or its old spelling); the error lists the names that exist."""
    known = {r.name: r for r in all_recipes()}
    if name not in known and current_name(name) in known:
        log.warning("recipe %r is now %r; the old name keeps working", name, current_name(name))
        name = current_name(name)
    if name not in known:
        raise ConfigError(f"no recipe named {name!r}{did_you_mean(name, known)} (`qvl recipes` lists all)")
    return known[name]
