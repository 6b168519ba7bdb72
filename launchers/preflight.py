"""Checks before submission: parallel layout against the world size, required executor settings, mounts.

Each check raises `LaunchError` naming the offending value and the change that fixes it, so a bad
launch fails on the laptop in a second instead of in the queue an hour later.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qvl.launchers.overrides import LaunchError, missing_required

LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """The model-parallel sizes of a run (data parallel fills the rest of the world)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1

    @classmethod
    def from_settings(cls, registered: dict[str, Any], overrides: dict[str, Any]) -> Layout:
        """The recipe's registered layout with the user's overrides of the same names on top."""
        merged = {k: v for k, v in (registered | overrides).items() if k in LAYOUT_KEYS and v is not None}
        for key, value in merged.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LaunchError(f"{key}={value!r} must be a positive integer")
        return cls(**merged)

    @property
    def model_parallel(self) -> int:
        """Ranks one dense model replica spans: TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def expert_model_parallel(self) -> int:
        """Ranks one expert replica spans: TP x PP x EP (expert TP defaults to TP in Megatron)."""
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel

    def describe(self, include_ep: bool) -> str:
        names = ["tensor_parallel", "pipeline_parallel", "context_parallel"] + (
            ["expert_parallel"] if include_ep else []
        )
        used = [n for n in names if getattr(self, n) > 1] or ["tensor_parallel"]
        return " x ".join(f"{n}={getattr(self, n)}" for n in used)


def check_world_size(
    layout: Layout, *, nodes: int, per_node: int, per_node_name: str = "gpus_per_node", gpu: bool = True
) -> None:
    """Fail when the world (nodes x per_node ranks) cannot hold the layout."""
    world = nodes * per_node
    shape = f"nodes={nodes} x {per_node_name}={per_node}"
    needed = math.lcm(layout.model_parallel, layout.expert_model_parallel)
    uses_ep = layout.expert_parallel > 1
    what = layout.describe(include_ep=uses_ep)
    if world < needed:
        raise LaunchError(
            f"world size {world} ({shape}) is smaller than the recipe's layout {what} = {needed} ranks; "
            f"{_fix(needed, nodes, per_node, per_node_name)}"
        )
    if world % needed:
        raise LaunchError(
            f"world size {world} ({shape}) is not divisible by {what} = {needed}; "
            f"{_fix(needed, nodes, per_node, per_node_name)}"
        )
    if gpu and layout.tensor_parallel > per_node:
        raise LaunchError(
            f"tensor_parallel={layout.tensor_parallel} is larger than {per_node_name}={per_node}: "
            "tensor parallelism all-reduces in every layer and must stay inside one node's NVLink "
            f"domain; use tensor_parallel<={per_node} and spread across nodes with pipeline_parallel"
        )


def check_recipe_gpus(
    recipe: str, sized_for: int | None, *, nodes: int, per_node: int, layout_overridden: bool
) -> None:
    """Fail when a GPU world is smaller than the recipe was sized for (its registered `gpus`), unless the
    user changed the layout (then memory per GPU is theirs to judge)."""
    world = nodes * per_node
    if not sized_for or layout_overridden or world >= sized_for:
        return
    fix = -(-sized_for // per_node)
    raise LaunchError(
        f"recipe {recipe} is sized for {sized_for} GPUs but the executor has {world} "
        f"(nodes={nodes} x gpus_per_node={per_node}); use nodes={fix}, or override the layout "
        "(tensor_parallel=..., pipeline_parallel=...) if a smaller run fits in memory"
    )


def _fix(needed: int, nodes: int, per_node: int, per_node_name: str) -> str:
    """Node counts near `nodes` whose world size fits `needed`."""
    fits = [n for n in range(1, max(2 * nodes, needed) + 2) if n * per_node >= needed and (n * per_node) % needed == 0]
    below = [n for n in fits if n < nodes][-1:]
    above = [n for n in fits if n > nodes][:1]
    if below or above:
        return "use " + " or ".join(f"nodes={n}" for n in below + above)
    return f"use a {per_node_name} that is a multiple of {needed}, or a smaller layout"


def check_required(kind: str, factory: Callable[..., Any], settings: dict[str, Any]) -> None:
    """Fail when a setting the `kind` executor cannot do without is absent."""
    missing = missing_required(factory, settings)
    if missing:
        flags = " ".join(f"run.executor.{name}=..." for name in missing)
        raise LaunchError(
            f"the {kind} executor needs {', '.join(missing)}: set them in the site file "
            f"(--executor-config site.yaml, section {kind}:) or pass {flags}"
        )


def check_accepted(kind: str, accepted: set[str], settings: dict[str, Any]) -> None:
    """Fail on a setting the `kind` executor does not have (a typo would otherwise be ignored)."""
    unknown = sorted(set(settings) - accepted)
    if unknown:
        raise LaunchError(
            f"the {kind} executor has no setting {', '.join(unknown)}; it takes: {', '.join(sorted(accepted))}"
        )


def check_mounts(mounts: Sequence[str]) -> None:
    """Fail on a `src:dst` mount whose source is not readable here (dry runs on the submitting host)."""
    for mount in mounts:
        src = mount.split(":", 1)[0]
        if not src.startswith("/"):
            raise LaunchError(f"mount {mount!r}: the source must be an absolute path (src:dst)")
        if not os.access(src, os.R_OK):
            raise LaunchError(
                f"mount {mount!r}: {src} does not exist or is not readable here; fix the path in "
                "mounts=[...] (or the site file), or dry-run on a host that sees the cluster's filesystem"
            )


def check_ssh_job_dir(settings: dict[str, Any]) -> None:
    """Fail when a Slurm launch over SSH has no experiments folder on the cluster."""
    if settings.get("host") and not settings.get("job_dir"):
        raise LaunchError(
            f"slurm over SSH (host={settings['host']}) needs job_dir: the experiments folder on the "
            "cluster's shared filesystem, e.g. run.executor.job_dir=/lustre/$USER/qvl"
        )
