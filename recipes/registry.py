"""The recipe registry: every recipe function, looked up by name from the CLI, NeMo-Run and the planner.

A recipe is a function of keyword arguments returning a Megatron-Bridge `ConfigContainer`. Family
modules register theirs with `@recipe(family=..., size=..., stage=...)`; the registry imports the family
modules on first lookup, so `qvl recipes` sees them all without importing Megatron at CLI start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Modules that define recipes; imported lazily by `all_recipes()`.
RECIPE_MODULES: tuple[str, ...] = ("qvl.recipes.qwen2_vl", "qvl.recipes.qwen2_5_vl", "qvl.recipes.qwen3_vl")

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
    return sorted(_RECIPES.values(), key=lambda r: (r.family, r.size, STAGES.index(r.stage), r.name))


def get_recipe(name: str) -> RecipeInfo:
    """The recipe called `name`; the error lists the names that exist."""
    known = {r.name: r for r in all_recipes()}
    if name not in known:
        close = [n for n in known if name.split("_")[0] in n][:8] or sorted(known)[:8]
        raise KeyError(f"no recipe named {name!r}; did you mean one of: {', '.join(close)}? (`qvl recipes` lists all)")
    return known[name]
