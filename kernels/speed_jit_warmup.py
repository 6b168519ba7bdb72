"""Megatron-Bridge's setup warms up only the fused functions the model calls (patch group "speed-jit-warmup").

Before the first step, Megatron-Bridge 0.6.2's setup (`set_jit_fusion_options`, megatron/bridge/training/
initialize.py) runs the fused bias-activation and bias-dropout-add functions ten times each on sample tensors, so that
their `torch.compile` happens before training. It does so whatever the model's config says, also where both fusions
are off and the model never calls them: every CPU run (qvl turns them off there) and every run that turns them off.
Compiling them took ~7.7 s of CPU in a new process, in every rank started for a run.

With the group applied the warm-up runs, as upstream's, when the config turns either fusion on, and not at all when
both are off (on torch >= 2.2 the function does nothing else).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GROUP = "speed-jit-warmup"


def fusions_in_use(model_config: Any) -> bool:
    """Whether the model calls a fused function that the warm-up compiles."""
    config = getattr(model_config, "transformer", model_config)  # Megatron-Bridge's GPTModelConfig wraps it
    return bool(getattr(config, "bias_activation_fusion", True) or getattr(config, "bias_dropout_fusion", True))


def warm_up_what_is_used(original: Callable[..., None]) -> Callable[..., None]:
    """`set_jit_fusion_options` that skips the warm-up of fusions the model does not use."""

    def set_jit_fusion_options(model_config: Any, micro_batch_size: int) -> None:
        if fusions_in_use(model_config):
            original(model_config, micro_batch_size)

    return set_jit_fusion_options
