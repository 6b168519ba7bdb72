"""Kubeflow Trainer v2.2+ TrainJobs from NeMo-Run 0.11.1 (patch group "fix-kubeflow-v2.2" of qvl.foundation.patches).

Trainer v2.2 takes pod settings (volumes, mounts, pull secrets) as `spec.runtimePatches`; NeMo-Run 0.11.1 renders only
v2.1's `spec.podTemplateOverrides`, which a newer server drops, so pods start without their volumes (see
kubeflow/trainer#3309). qvl's Kubeflow executor for v2.2+ carries an empty `spec.runtimePatches` in its spec_kwargs
(qvl.launchers.executors); while this group is applied, the rendered overrides move there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

GROUP = "fix-kubeflow-v2.2"
RUNTIME_PATCHES = "runtimePatches"
RUNTIME_PATCH_MANAGER = "qvl.launchers"


def runtime_patches_job_body(original: Callable[..., dict]) -> Callable[..., dict]:
    """KubeflowExecutor.get_job_body that renders podTemplateOverrides as runtimePatches where the spec asks."""

    @functools.wraps(original)
    def get_job_body(self, name: str, command: list[str]) -> dict:
        body = original(self, name, command)
        if RUNTIME_PATCHES in body["spec"]:
            move_overrides_to_runtime_patches(body["spec"])
        return body

    return get_job_body


def move_overrides_to_runtime_patches(spec: dict) -> None:
    """Rewrite a TrainJob spec's v2.1 `podTemplateOverrides` as one v2.2+ `runtimePatches` entry (same pod fields,
    under trainingRuntimeSpec.template.spec.replicatedJobs[].template.spec.template)."""
    jobs = [
        {"name": target["name"], "template": {"spec": {"template": {k: o[k] for k in ("metadata", "spec") if k in o}}}}
        for o in spec.pop("podTemplateOverrides", [])
        for target in o["targetJobs"]
    ]
    patches = [p for p in spec[RUNTIME_PATCHES] if p.get("manager") != RUNTIME_PATCH_MANAGER]
    if jobs:
        patch = {"template": {"spec": {"replicatedJobs": jobs}}}
        patches.append({"manager": RUNTIME_PATCH_MANAGER, "trainingRuntimeSpec": patch})
    if patches:
        spec[RUNTIME_PATCHES] = patches
    else:
        del spec[RUNTIME_PATCHES]
