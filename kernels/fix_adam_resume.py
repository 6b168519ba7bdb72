"""Fixes for Megatron-Core 0.19.2's distributed optimizer when it falls back to `torch.optim.Adam`.

Without Transformer Engine or Apex (CPU, and GPUs without TE such as a bare PyTorch install) the
distributed optimizer wraps torch's Adam, and resuming from a checkpoint breaks twice:
1. `DistributedOptimizer.state_dict()` collects each parameter's Adam `step` and asserts there is
   exactly one value. A fresh optimizer (no update yet) has no state at all, so building the
   checkpoint template on resume fails with a bare `AssertionError`. Fix: while that call runs, give
   each parameter a temporary `step` of 0 (what torch Adam starts from), then remove it again, so the
   optimizer stays "fresh" for upstream's load path (which allocates state only when it is empty; a
   permanent initial state would make the dp-reshardable load copy the template's step 0 over the
   checkpoint's).
2. `DistributedOptimizer.load_state_dict()` assigns ONE `step` tensor object to every parameter's state
   (torch Adam increments each parameter's `step` in place, so every update would bump the shared
   counter once per parameter), and the dp-reshardable parameter-state load then copies the load
   template's `step` (that of a fresh optimizer: 0) over it. Adam's bias correction restarts, and
   losses drift from the uninterrupted run from the second step after a resume. Fix: after loading,
   give each parameter its own `step` tensor holding the checkpoint's step, read from its param groups.
Both apply on any device where neither TE nor Apex provides the optimizer; the switch (qvl.kernels.switch) applies
the group around every training loop there, with the other groups such a run needs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

GROUP = "fix-adam-resume"


@contextlib.contextmanager
def _temporary_initial_steps(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """On a torch Adam without any state, give every parameter `step` 0 for the duration of the block."""
    fresh = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and len(optimizer.state) == 0
    params = [p for group in optimizer.param_groups for p in group["params"]] if fresh else []
    for param in params:
        optimizer.state[param] = {"step": torch.tensor(0.0, dtype=torch.float32)}
    try:
        yield
    finally:
        for param in params:
            optimizer.state.pop(param, None)


def _restore_steps(optimizer: torch.optim.Optimizer, step: float | None) -> None:
    """Give every parameter state its own `step` tensor, holding the checkpoint's `step`."""
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            # on the device torch put it (a fused or capturable Adam keeps `step` with its parameter)
            value = state["step"] if step is None else torch.tensor(step, device=state["step"].device)
            state["step"] = value.detach().clone().to(torch.float32)


def _checkpoint_step(state_dict: dict) -> float | None:
    steps = {group.get("step") for group in state_dict.get("optimizer", {}).get("param_groups", [])} - {None}
    return float(steps.pop()) if len(steps) == 1 else None


# Replacement factories named by qvl.foundation.patches.


def state_dict_with_initial_steps(original):
    @functools.wraps(original)
    def state_dict(self):
        with _temporary_initial_steps(self.optimizer):
            return original(self)

    return state_dict


def load_state_dict_with_own_steps(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        step = _checkpoint_step(state_dict)  # read first: the upstream load consumes parts of state_dict
        result = original(self, state_dict)
        _restore_steps(self.optimizer, step)
        return result

    return load_state_dict
