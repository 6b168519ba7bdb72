"""The gradients of a model's 1-D parameters (biases, norm weights) added into Megatron-Core's `main_grad` by two
foreach kernels when a backward ends, not by one kernel each as autograd hands them over (patch group
"speed-small-grads" of qvl.foundation.patches).

Megatron-Core's DDP registers a hook per parameter (`DistributedDataParallel._make_backward_post_hook`,
megatron/core/distributed/distributed_data_parallel.py) that adds the parameter's `.grad` into its fp32 `main_grad`
as soon as autograd has it. A weight's gradient goes into `main_grad` inside its GEMM (qvl.kernels.torch_wgrad_accum)
and the hook skips it; what the hooks still add are the 1-D parameters' gradients, a few thousand elements each and
one launch each per micro-batch: with qvl's own bias-sum adds (below), 1,600 of the 12,217 launches of the step
census's Qwen2.5-VL step and ~2,800 of Qwen3-VL-4B's 21,562 (benchmarks/RESULTS.md), where the host launches about as
fast as the GPU runs.

Here a 1-D parameter's hook keeps the gradient (and releases the parameter's `.grad`, as upstream's does) and, at the
first such call in a backward, asks autograd's engine to call `SmallGradients.flush` when that backward ends
(`queue_callback`): one `_foreach_copy_` widens the kept bf16 gradients into an fp32 scratch buffer (its CUDA kernel
converts dtypes on its fast path), one `_foreach_add_` adds them into their `main_grad`s (each launch covers up to 64
tensors, 448 with CUDA 13 builds). Every element is its gradient widened to fp32 and added once, as upstream's `add_`
does: `main_grad` is the same bit for bit. The gradients are held until the backward ends: a few MB for a Qwen-VL
model. A recomputed region's reentrant backward (Megatron-Core's `CheckpointFunction`) is a backward of its own inside
the outer one: its gradients go in when it ends. A backward that raises leaves what it kept out of `main_grad`
(upstream's hooks would have added those that had run; the run stops there either way).

qvl's own bias-gradient regions (the HF vision tower's qkv, gate and up projections: qvl.kernels.speed_hf_vision,
qvl.kernels.hf_vision_mlp) sum a bias gradient in fp32 and add it into `main_grad` themselves; they hand the sum to
the same batch (`add_into_main_grad`).

Upstream's hook stays where a backward must see each gradient as it arrives or a hook runs outside autograd's
engine: DDP overlapping its gradient reduction with the backward (`overlap_grad_reduce`, off in qvl's recipes: a
bucket's reduction starts when its last hook has run), Megatron-Core's delayed weight-gradient and GTP
rematerialisation paths, any hook called outside a backward, and a 2-D or larger parameter. Under CUDA graph capture
both hooks return at once, as upstream's does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any

import torch

from qvl.foundation import patches

GROUP = "speed-small-grads"
# The DDP module's `SmallGradients`, kept on the module itself (made with its hooks, gone with it) and on each
# parameter whose hook keeps its gradients there.
_ATTRIBUTE = "_qvl_small_gradients"


def applied() -> contextlib.AbstractContextManager:
    """The group in place for a block (DDP modules built inside it get the batched hooks)."""
    return patches.applied(GROUP)


class SmallGradients:
    """The 1-D gradients one DDP module's hooks kept, each with the `main_grad` it goes into, by the backward
    (autograd graph task) that is running: a recomputed region's reentrant backward runs inside the outer one and ends
    first. `flush` adds a backward's gradients when it ends."""

    def __init__(self) -> None:
        self.kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # task -> [(main_grad, gradient)]

    def keep(self, main_grad: torch.Tensor, grad: torch.Tensor) -> None:
        """Keep `grad` for `main_grad` until the running backward ends (its first one asks the engine for the call).
        A backward that raises never ends: what it kept is never added (and stays held, a few MB, with the module)."""
        task = torch._C._current_graph_task_id()
        if task not in self.kept:
            self.kept[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self.flush, task))
        self.kept[task].append((main_grad, grad))

    def flush(self, task: int) -> None:
        """Add every gradient backward `task` kept into its `main_grad`: a widening copy and an add per kind of
        dtypes."""
        kept = self.kept.pop(task)
        kinds: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)
        for main_grad, grad in kept:
            kinds[main_grad.dtype, grad.dtype, main_grad.device].append((main_grad, grad))
        with torch.no_grad():
            for (main_dtype, grad_dtype, device), pairs in kinds.items():
                main_grads, grads = (list(column) for column in zip(*pairs, strict=True))
                if grad_dtype != main_dtype:
                    sizes = [grad.numel() for grad in grads]
                    widened = torch.empty(sum(sizes), dtype=main_dtype, device=device).split(sizes)
                    torch._foreach_copy_(widened, grads)
                    grads = widened
                torch._foreach_add_(main_grads, grads)


def add_into_main_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """`param.main_grad += grad` for a 1-D parameter whose gradient a backward adds itself (qvl's bias-gradient
    regions): kept with the DDP module's other small gradients until the running backward ends where its hook is this
    group's, else now."""
    small = getattr(param, _ATTRIBUTE, None)
    if small is not None and torch._C._current_graph_task_id() != -1:
        small.keep(param.main_grad, grad)
    else:
        param.main_grad.add_(grad)


def batched_hook(original):
    """Patch factory for `DistributedDataParallel._make_backward_post_hook`: a 1-D parameter's hook keeps its
    gradient for `SmallGradients.flush` at the end of the backward; every other hook is upstream's."""
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    @functools.wraps(original)
    def make_backward_post_hook(self, param: torch.nn.Parameter):
        ddp = self.ddp_config
        if (
            param.dim() != 1
            or ddp.overlap_grad_reduce
            or getattr(ddp, "delay_wgrad_compute", False)
            or getattr(param, "is_gtp_weight_remat", False)
        ):
            return original(self, param)
        upstream = original(self, param)  # every call this one does not keep a gradient of
        if not hasattr(self, _ATTRIBUTE):
            setattr(self, _ATTRIBUTE, SmallGradients())
        small: SmallGradients = getattr(self, _ATTRIBUTE)
        setattr(param, _ATTRIBUTE, small)

        def hook(*unused: Any) -> None:
            keeps = (
                torch._C._current_graph_task_id() != -1
                and not is_graph_capturing()
                and param in self.param_to_bucket_group
                and param.grad is not None
                and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False))
            )
            if not keeps:
                return upstream(*unused)
            small.keep(param.main_grad, param.grad.data)
            param.grad = None

        return hook

    return make_backward_post_hook
