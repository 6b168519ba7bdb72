"""The recipe registry: every recipe function, looked up by name from the CLI, NeMo-Run and the planner.

A recipe is a function of keyword arguments returning a Megatron-Bridge `ConfigContainer`. Family
modules register theirs with `@recipe(family=..., size=..., stage=...)`; the registry imports the family
modules on first lookup, so `qvl recipes` sees them all without importing Megatron at CLI start-up.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES
from qvl.recipes.options import did_you_mean

# Modules that define recipes (each family record names its own); imported lazily by `all_recipes()`.
RECIPE_MODULES: tuple[str, ...] = tuple(dict.fromkeys(f.recipe_module for f in FAMILIES.values()))

STAGES = ("pretrain", "sft", "peft")


@dataclass(kw_only=True, slots=True, frozen=True)
class RecipeInfo:
    """One registered recipe: its name, what it trains, and its default parallel layout."""

    name: str
    family: str
    size: str
    stage: str
    fn: Callable[..., Any]
    layout: dict[str, int] = field(default_factory=dict)
    summary: str = ""


_RECIPES: dict[str, RecipeInfo] = {}


def recipe(*, family: str, size: str, stage: str, name: str | None = None, **layout: int):
    """Register a recipe function under `name` (default: the function's name)."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        if key in _RECIPES and _RECIPES[key].fn is not fn:
            raise ValueError(f"recipe {key!r} is registered twice ({_RECIPES[key].fn.__module__} and {fn.__module__})")
        doc = (fn.__doc__ or "").strip().splitlines()
        _RECIPES[key] = RecipeInfo(
            name=key, family=family, size=size, stage=stage, fn=fn, layout=dict(layout), summary=doc[0] if doc else ""
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


def get_recipe(name: str) -> RecipeInfo:
    """The recipe called `name`; the error lists the names that exist."""
    known = {r.name: r for r in all_recipes()}
    if name not in known:
        raise ConfigError(f"no recipe named {name!r}{did_you_mean(name, known)} (`qvl recipes` lists all)")
    return known[name]
