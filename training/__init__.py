"""Training, one floor above the recipes: Megatron-Bridge's loop with qvl's forward step, vision balancing and the
training-parity check against transformers.

`qvl.training.train(config, run_dir=...)` trains a recipe's ConfigContainer (the path `qvl train` takes) and
`read_losses(run_dir)` reads its per-step losses back; both load Megatron-Bridge on first use.
"""

from typing import Any

_LOOP = ("train", "read_losses")


def __getattr__(name: str) -> Any:
    if name in _LOOP:  # loaded on use: it brings torch and Megatron-Bridge's training loop
        from qvl.training import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'qvl.training' has no attribute {name!r}")
