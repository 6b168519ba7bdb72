"""Defects put on purpose into an export's load of a checkpoint: each writes files that match the model the exporter
built, so only a check against the trained model (qvl.bridges.trained) sees them. Used with monkeypatch on
qvl.bridges.convert.load_megatron (a full checkpoint) and qvl.bridges.adapter_export.load_adapter_weights (a PEFT
run's adapters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VISION = ("vision_model.", "visual.")


def swap_experts(module: torch.nn.Module, *, adapters: bool) -> None:
    """Experts 0 and 1 of every MoE layer trade their weights (or their adapters)."""
    for name, first in list(module.named_parameters()):
        if ".local_experts.0." in name and (".adapter." in name) == adapters:
            second = module.get_parameter(name.replace(".local_experts.0.", ".local_experts.1."))
            with torch.no_grad():
                held = first.clone()
                first.copy_(second)
                second.copy_(held)


def skipped_vision(load_megatron: Callable[..., list]) -> Callable[..., list]:
    """`load_megatron` that leaves the vision tower's weights as built (here: drawn anew) instead of loading them."""

    def load(*args: Any, **kwargs: Any) -> list:
        model = load_megatron(*args, **kwargs)
        with torch.no_grad():
            for name, parameter in model[0].named_parameters():
                if name.startswith(VISION):
                    parameter.normal_(0, 0.02)
        return model

    return load


def swapped_experts(load_megatron: Callable[..., list]) -> Callable[..., list]:
    """`load_megatron` that swaps two experts' weights."""

    def load(*args: Any, **kwargs: Any) -> list:
        model = load_megatron(*args, **kwargs)
        swap_experts(model[0], adapters=False)
        return model

    return load


def skipped_vision_adapters(load_adapter_weights: Callable[..., None]) -> Callable[..., None]:
    """`load_adapter_weights` that skips the vision tower's and merger's adapter tensors (they keep their initial
    values: B zero)."""

    def load(model: list, adapters: Any, run: Any) -> None:
        initial = {
            name: p.detach().clone()
            for name, p in model[0].named_parameters()
            if name.startswith(VISION) and p.requires_grad  # the adapters: the base is frozen
        }
        assert initial, "no vision adapter to skip: the defect would test nothing"
        load_adapter_weights(model, adapters, run)
        with torch.no_grad():
            for name, value in initial.items():
                model[0].get_parameter(name).copy_(value)

    return load


def swapped_expert_adapters(load_adapter_weights: Callable[..., None]) -> Callable[..., None]:
    """`load_adapter_weights` that swaps two experts' adapters."""

    def load(model: list, adapters: Any, run: Any) -> None:
        load_adapter_weights(model, adapters, run)
        swap_experts(model[0], adapters=True)

    return load
