"""Which tensors weight decay touches, read from the optimizers the two frameworks built, compared by HF name.

A decay rule differing between the frameworks is invisible in a few steps' weights: decoupled decay moves a weight by
lr x wd x w per step (~0.014 lr on the tiny models' largest matrices, against a 0.1 lr tolerance), and a reference that
decayed nothing passed on weights against a qvl run that decayed every matrix. So the check reads each framework's
decay per parameter from the optimizer it built (Megatron's param groups after the scheduler's `wd_mult`; the
Trainer's groups) and compares them tensor by tensor under HF names, exported through the same mappings as the
weights: a difference is a failure at any step count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MAX_LISTED = 5


def megatron_decay(optimizer: Any) -> dict[torch.Tensor, float]:
    """Model parameter -> the weight decay Megatron-Core's optimizer applies to it (its param group's, after the
    scheduler's `wd_mult`), for the distributed optimizer, the fp32 / mixed-precision ones, and a chain of them."""
    decay: dict[torch.Tensor, float] = {}
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        groups = part.optimizer.param_groups
        index = getattr(part, "model_param_group_index_map", None)  # DistributedOptimizer: model param -> group
        if index is not None:
            decay.update({param: float(groups[g]["weight_decay"]) for param, (g, _) in index.items()})
            continue
        if hasattr(part, "float16_groups"):  # mixed precision: the model's params beside the fp32 copies
            model_groups = [a + b for a, b in zip(part.float16_groups, part.fp32_from_fp32_groups, strict=True)]
        else:
            model_groups = [group["params"] for group in groups]
        for params, group in zip(model_groups, groups, strict=True):
            decay.update({param: float(group["weight_decay"]) for param in params})
    return decay


def megatron_no_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron-Core's rule (optimizer.get_standard_config_overrides): biases and 1-D tensors get no weight decay.
    The bridge maps 1-D tensors to 1-D tensors, so the rule reads the same on HF names."""
    return param.ndim == 1 or name.endswith(".bias")


def torch_decay(optimizer: Any) -> dict[torch.Tensor, float]:
    """Parameter -> weight decay of a torch (or accelerate-wrapped) optimizer's param groups."""
    return {param: float(group["weight_decay"]) for group in optimizer.param_groups for param in group["params"]}


def as_markers(decay: dict[torch.Tensor, float]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A parameter -> a tensor of its shape holding its decay (0 for a parameter no optimizer holds), float64."""
    return lambda param: torch.full_like(param, decay.get(param, 0.0), dtype=torch.float64)


def by_name(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Exported marker tensors -> the decay each HF tensor gets (the largest, if pieces of one differ)."""
    return {name: float(tensor.double().abs().max()) if tensor.numel() else 0.0 for name, tensor in tensors.items()}


def mismatches(ours: dict[str, float], reference: dict[str, float]) -> list[str]:
    """The HF tensors the two optimizers decay differently, as `name (qvl x vs transformers y)`."""
    # relative to float32: a coefficient may have passed through an fp32 tensor on one side (0.1 -> 0.10000000149)
    names = sorted(
        n for n in set(ours) & set(reference) if abs(ours[n] - reference[n]) > 1e-6 * max(ours[n], reference[n])
    )
    return [f"{n} ({ours[n]:g} vs {reference[n]:g})" for n in names]


def failure(ours: dict[str, float], reference: dict[str, float]) -> list[str]:
    """One failure line when the optimizers decay any tensor differently (none when neither side recorded)."""
    if not ours or not reference:
        return []
    different = mismatches(ours, reference)
    if not different:
        return []
    return [
        f"weight decay differs on {len(different)} tensors between the optimizers the two frameworks built: "
        + ", ".join(different[:MAX_LISTED])
    ]
