"""One way for tests to build a family's tiny Megatron model (the family record's debug flavour, fp32, CPU).

Call it where a process group is up (`qvl.foundation.distributed.init_distributed()`). With `hf` (a tiny checkpoint
written by `qvl.bridges.tiny_model.write_tiny_hf_checkpoint`) the weights are the checkpoint's, loaded through the
bridge; without, they are drawn from `seed` for the record's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_megatron_model(
    family: str, *, hf: Path | None = None, speed: bool = True, seed: int = 0, **provider_fields: Any
) -> tuple[Any, Any]:
    """(model, HF config) of `family`'s tiny model, built by qvl's provider: `speed` as training builds it (every
    provider fix: varlen vision attention, the lean HF tower, fused weight-gradient accumulation), else the bridge's
    corrections only (what a comparison with upstream or transformers takes); `provider_fields` set before
    `finalize()` (e.g. gradient_accumulation_fusion=False where no DDP wrapper gives a main_grad)."""
    import torch

    from qvl.bridges.convert import auto_bridge_with_weights
    from qvl.bridges.fixes import fix_provider
    from qvl.bridges.providers import apply_provider_fixes, auto_bridge
    from qvl.bridges.tiny_model import tiny_hf_config

    if hf is None:
        hf_config = tiny_hf_config(family)
        provider = auto_bridge(hf_config).to_megatron_provider(load_weights=False)
    else:
        bridge = auto_bridge_with_weights(hf, torch.float32)
        hf_config = bridge.hf_pretrained.config
        provider = bridge.to_megatron_provider(load_weights=True)
    (apply_provider_fixes if speed else fix_provider)(provider, hf_config)
    for name, value in provider_fields.items():
        setattr(provider, name, value)
    provider.finalize()
    torch.manual_seed(seed)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    return model, hf_config
