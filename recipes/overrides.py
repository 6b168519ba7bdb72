"""`section.field=value` overrides applied to a built Megatron-Bridge ConfigContainer (what `qvl launch` forwards)."""

from __future__ import annotations

import dataclasses
from typing import Any

from qvl.foundation.errors import LaunchError


def apply_config_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """Set dotted fields (`train.train_iters`) on a built config; an unknown field is an error."""
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        target = config
        for name in parents:
            if not hasattr(target, name):
                raise LaunchError(f"override {dotted}: the config has no field {name!r} ({_fields_hint(target)})")
            target = getattr(target, name)
        if not hasattr(target, leaf):
            raise LaunchError(
                f"override {dotted}: {type(target).__name__} has no field {leaf!r} ({_fields_hint(target)})"
            )
        setattr(target, leaf, value)
    return config


def _fields_hint(obj: Any) -> str:
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    return "fields: " + ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "not a dataclass"
