"""The kinds of entry in qvl.foundation.patches' registry, and how an entry's string names an upstream object.

A registry string is "package.module:Owner.attribute" (or "package.module:name"); `load` imports and returns what it
names. A patch group's name says its kind first ("<kind>-<subject>", a key of `KINDS`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# What a group changes, named by the first word of the group's name ("<kind>-<subject>").
KINDS: dict[str, str] = {
    "cpu": "the CPU runtime: Megatron's CUDA-only paths taken on the CPU",
    "torch": "a torch stand-in for a missing Transformer Engine, Apex or flash-linear-attention piece",
    "fix": "a fix of an upstream bug",
    "speed": "a faster path to upstream's results",
}


def kind_of(group: str) -> str:
    """A group's kind (a key of KINDS): the first word of its name."""
    return group.partition("-")[0]


@dataclass(kw_only=True, slots=True, frozen=True)
class Patch:
    """An upstream attribute replaced while its group is applied."""

    group: str
    target: str  # "package.module:Owner.attribute"
    replacement: str  # "qvl.module:factory", factory(original) -> replacement
    why: str
    version: str
    params: tuple[str, ...] | None = None  # leading parameter names of the original, checked by the tests
    # The attribute exists only where an optional package imported (e.g. Apex's kernels): absent, it is added (the
    # factory gets None) and removed again on undo; the tests check that the module still refers to the name.
    absent_ok: bool = False

    @property
    def kind(self) -> str:
        """What the entry changes (a key of KINDS), as its group's name says."""
        return kind_of(self.group)


@dataclass(kw_only=True, slots=True, frozen=True)
class StandIn:
    """An upstream module that imports an optional package unconditionally."""

    module: str  # the importing module
    package: str  # the optional package
    submodule: str  # what it imports from the package
    advice: str  # what to do instead, shown when code reaches the stand-in
    version: str
    kind = "torch"  # a stand-in for a missing optional package (KINDS)


@dataclass(kw_only=True, slots=True, frozen=True)
class KeptOut:
    """An installed package that an upstream plugin loader would import along with Megatron-Bridge, kept out of that
    one import because qvl never uses the plugin (the loader skips a package it cannot import); it stays importable
    afterwards."""

    package: str
    plugin_loader: str  # the upstream module that imports it if it can
    why: str
    version: str
    kind = "speed"  # nothing changes but what an import costs


@dataclass(kw_only=True, slots=True, frozen=True)
class PrivateRead:
    """A private upstream name that qvl reads or overrides (never replaces)."""

    target: str  # "package.module:Owner" (+ attribute); instance attributes are checked in the class source
    attribute: str
    used_in: str
    why: str
    version: str


@dataclass(kw_only=True, slots=True, frozen=True)
class Fork:
    """An upstream function (or class) whose body qvl copies and changes; its source is pinned by hash."""

    upstream: str  # "package.module:Owner.attribute"
    copied_in: str  # "qvl.module:function" holding qvl's copy
    source_sha256: str  # the first 16 hex digits of sha256(inspect.getsource(upstream))
    version: str


def load(path: str) -> Any:
    """The object named by "package.module:Owner.attribute" (or "package.module:name")."""
    module_name, _, qualname = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else []:
        obj = getattr(obj, part)
    return obj


def owner_and_name(target: str) -> tuple[Any, str]:
    """The object that holds `target`'s attribute, and the attribute's name."""
    module_name, _, qualname = target.partition(":")
    owner_path, _, name = qualname.rpartition(".")
    return load(f"{module_name}:{owner_path}"), name


def signature_names(obj: Any) -> tuple[str, ...]:
    """Parameter names of a callable, in order."""
    return tuple(inspect.signature(obj).parameters)
