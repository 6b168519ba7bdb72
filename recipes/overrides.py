"""The one `key=value` override grammar, used by `qvl train`, `qvl plan`, `qvl launch` and `nemo qvl`.

A key is a recipe option (`tensor_parallel=4`, a field of `qvl.recipes.options.RecipeOptions`) or a dotted field
of the built Megatron-Bridge ConfigContainer (`train.train_iters=100`). Values read like YAML scalars and lists,
with two exceptions that YAML 1.1 gets wrong for a command line: `1e-4` is a float (YAML wants `1.0e-4`) and
`04:00:00` stays a string (YAML reads base-60 integers); `none`/`null` are None, `true`/`false` bools, and
quoting ('4') keeps a string. The submitting side and the job parse the same text with the same function, so
the config a dry run prints is the config the job builds. Unknown keys are refused with a did-you-mean.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from qvl.foundation.errors import ConfigError
from qvl.recipes.options import check_option_names, check_option_values, did_you_mean, option_names

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_value(text: str) -> Any:
    """A command-line value: int, float (`1e-4`), bool, None (`none`/`null`), a `[a, b]` list, else the string."""
    s = text.strip()
    lowered = s.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null", "~"):
        return None
    if _INT.fullmatch(s):
        return int(s)
    if _FLOAT.fullmatch(s):
        return float(s)
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if s.startswith(("[", "{")):
        try:
            loaded = yaml.safe_load(s)
        except yaml.YAMLError as err:
            raise ConfigError(f"value {text!r} is not a valid list or mapping ({err.problem}); e.g. [a, b]") from err
        return _parse_items(loaded)
    return text


def _parse_items(value: Any) -> Any:
    if isinstance(value, list):
        return [_parse_items(v) for v in value]
    if isinstance(value, dict):
        return {k: _parse_items(v) for k, v in value.items()}
    return parse_value(value) if isinstance(value, str) else value


def split_pair(pair: str) -> tuple[str, str]:
    """`key=value` -> (key, value text)."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {pair!r} is not key=value; e.g. tensor_parallel=4 or train.train_iters=100")
    return key.strip(), value


EXECUTOR_PREFIX = "run.executor."


@dataclass(kw_only=True, slots=True)
class Overrides:
    """Parsed `key=value` overrides sorted by what they change, and the original texts.

    `options` are recipe options (`tensor_parallel=4`), `config` dotted fields of the built ConfigContainer
    (`train.train_iters=100`), `executor` fields of a launch's executor (`run.executor.nodes=2`)."""

    options: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    executor: dict[str, Any] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, values: dict[str, Any]) -> Overrides:
        """An already-parsed mapping (options and dotted fields together) sorted into options and config."""
        return cls(
            options={k: v for k, v in values.items() if "." not in k},
            config={k: v for k, v in values.items() if "." in k},
        )

    def as_dict(self) -> dict[str, Any]:
        """Options and dotted fields in one mapping (what `qvl train` and `plan_recipe` take)."""
        return self.options | self.config


def parse_overrides(pairs: Sequence[str], *, options: Sequence[str] | None = None, executor: bool = False) -> Overrides:
    """Sort `key=value` pairs into recipe options, dotted config fields and (with `executor`) executor fields.

    `options` are the accepted option names (default: every RecipeOptions field); an unknown option is an error.
    `texts` keeps the recipe and config pairs as given, for a job to parse again on its side."""
    known = list(options if options is not None else option_names())
    out = Overrides()
    for pair in pairs:
        key, text = split_pair(pair)
        value = parse_value(text)
        if executor and key.startswith(EXECUTOR_PREFIX):
            out.executor[key.removeprefix(EXECUTOR_PREFIX)] = value
            continue
        if key.startswith("run."):
            raise ConfigError(
                f"override {key!r}: only run.executor.<field> is supported under run. (and only by a launch)"
            )
        if "." in key:
            out.config[key] = value
        else:
            check_option_names([key], known)
            out.options[key] = value
        out.texts.append(pair)
    if options is None:
        out.options = check_option_values(out.options)
    return out


def apply_config_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """Set dotted fields (`train.train_iters`) on a built config; an unknown field is an error with a did-you-mean."""
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        target = config
        for depth, name in enumerate([*parents, leaf]):
            names = _field_names(target)
            if not (name in names if names is not None else hasattr(target, name)):
                where = ".".join(parents[:depth]) or "the config"
                raise ConfigError(
                    f"override {dotted}: {where} ({type(target).__name__}) has no field {name!r}"
                    f"{did_you_mean(name, names or [])}"
                )
            if depth < len(parents):
                target = getattr(target, name)
        setattr(target, leaf, value)
    return config


def _field_names(obj: Any) -> list[str] | None:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return None
