"""A one-pass optimizer step for Megatron-Core 0.19.2's optimizer without Transformer Engine or Apex (patch group
"speed-optimizer" of qvl.foundation.patches).

Without TE or Apex, Megatron-Core falls back to Python loops over the parameter tensors
(megatron/core/utils.py `local_multi_tensor_l2_norm` / `local_multi_tensor_scale`): the gradient norm reads one
scalar per tensor back to the host (`torch.tensor([t.norm() ...])`), and the clip scale and the main-to-model
parameter copy launch one kernel per tensor. torch's AdamW runs as foreach kernels, whose temporaries hold a copy
of the whole optimizer state. Here:
- `foreach_l2_norm`: one `torch._foreach_norm` and one norm of the stacked norms, on the device: no host read
  (Megatron-Core then reads the total once, `get_grad_norm_fp32`);
- `foreach_scale`: one `torch._foreach_mul_` (or a foreach multiply and copy);
- `foreach_main_to_model_copy`: the distributed optimizer's main-to-model copy as one `torch._foreach_copy_` over
  views made once;
- `fused_adam`: torch's fused AdamW kernel where the parameters' device has one (CUDA, and CPU since torch 2.4).

The norm, scale and copy give bitwise the same values as the loops they replace (same per-tensor reductions on the
CPU; on CUDA the foreach norm may round its last bit differently). Fused AdamW computes the same update in one
kernel and may round differently from the foreach one: losses agree within fp32 rounding, and a resumed run still
equals the uninterrupted one bit for bit (both take the same path).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from qvl.foundation import patches

logger = logging.getLogger(__name__)
GROUP = "speed-optimizer"
# (model shards, main shards) of an optimizer, kept on the optimizer itself: derived once, gone with it.
_PAIRS_ATTRIBUTE = "_qvl_copy_pairs"


def applied() -> contextlib.AbstractContextManager:
    """The group in place for a block (training entry points wrap Megatron-Bridge's loop in it)."""
    return patches.applied(GROUP)


# Replacement factories named by qvl.foundation.patches.


def foreach_l2_norm(original):
    """`l2_norm_impl` of megatron/core/optimizer/clip_grads.py: the total L2 norm as a device tensor [1]."""

    @functools.wraps(original)
    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        tensors = [t for t in tensor_lists[0] if t.numel()]
        if per_tensor or not tensors:
            return original(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None

    return l2_norm


def foreach_scale(original):
    """`multi_tensor_scale_impl`: dst = src * scale for every pair, in one foreach call."""

    @functools.wraps(original)
    def scale(chunk_size, noop_flag, tensor_lists, factor):
        sources, targets = tensor_lists
        if not sources:
            return None
        if all(s is t for s, t in zip(sources, targets, strict=True)):
            torch._foreach_mul_(targets, factor)
        else:
            torch._foreach_copy_(targets, torch._foreach_mul(sources, factor))
        return None

    return scale


def foreach_main_to_model_copy(original):
    """`DistributedOptimizer._copy_main_params_to_model_params` as one foreach copy into the parameter buffer."""

    @functools.wraps(original)
    def copy_main_params_to_model_params(self):
        pairs = _copy_pairs(self)
        if pairs is None:
            return original(self)
        targets, sources = pairs
        if targets:
            torch._foreach_copy_(targets, sources)
        return None

    return copy_main_params_to_model_params


def _copy_pairs(optimizer) -> tuple[list, list] | None:
    """(model-buffer shards, main shards) as upstream's copy_group_params pairs them, derived once per optimizer and
    kept on it; None where upstream's path does more than copy (FSDP, quantized parameters, precision-aware
    optimizer)."""
    if not hasattr(optimizer, _PAIRS_ATTRIBUTE):
        setattr(optimizer, _PAIRS_ATTRIBUTE, _derive_copy_pairs(optimizer))
    return getattr(optimizer, _PAIRS_ATTRIBUTE)


def _derive_copy_pairs(optimizer) -> tuple[list, list] | None:
    ddp, config = optimizer.ddp_config, optimizer.config
    if (
        optimizer.is_stub_optimizer
        or ddp.use_megatron_fsdp
        or ddp.fp8_param_gather
        or ddp.fp4_param_gather
        or config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    ):
        return None
    targets, sources = [], []
    groups = [(optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups),
              (optimizer.shard_fp32_groups, optimizer.model_fp32_groups)]  # fmt: skip
    for shard_groups, model_groups in groups:
        for shard_group, model_group in zip(shard_groups, model_groups, strict=True):
            for main, param in zip(shard_group, model_group, strict=True):
                if optimizer._is_distopt_quantized_param(param):
                    return None
                world = optimizer._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                buffer_index, _, bucket = optimizer.model_param_gbuf_map[param]
                flat = optimizer.buffers[buffer_index].buckets[bucket].param_data.view(-1)
                targets.append(flat[world.start : world.end])
                sources.append(main)
    return targets, sources


def fused_adam(original):
    """Megatron-Core's optimizer factory, whose torch Adam/AdamW then runs fused where the device has the kernel."""

    @functools.wraps(original)
    def build(*args, **kwargs):
        result = original(*args, **kwargs)
        for inner in _torch_adams(result[0] if isinstance(result, tuple) else result):
            use_fused_kernel(inner)
        return result

    return build


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [getattr(o, "optimizer", o) for o in chained]
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def use_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a torch Adam/AdamW to its fused kernel where every parameter's device and dtype has one (True)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    params = [p for group in optimizer.param_groups for p in group["params"]]
    devices = set(_get_fused_kernels_supported_devices())
    usable = params and all(p.device.type in devices and p.dtype.is_floating_point for p in params)
    if not usable or any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True  # as torch's constructor sets it for fused=True
    logger.debug("torch %s: fused kernel on %d tensors", type(optimizer).__name__, len(params))
    return True
