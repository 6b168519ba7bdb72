"""Recipe functions: one module per Qwen-VL family, each returning a Megatron-Bridge ConfigContainer.

`qvl.recipes.train(config, run_dir=...)` trains one (the path `qvl train` takes), `read_losses(run_dir)` reads
its per-step losses back; both load Megatron-Bridge on first use.
"""

from typing import Any

_TRAINING = ("train", "read_losses")


def __getattr__(name: str) -> Any:
    if name in _TRAINING:  # loaded on use: it brings torch and Megatron-Bridge's training loop
        from qvl.recipes.training import train as training

        return getattr(training, name)
    raise AttributeError(f"module 'qvl.recipes' has no attribute {name!r}")
