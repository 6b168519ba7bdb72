"""qvl's compiled regions: small pure functions of the step that run as one `torch.compile`d graph each way on a
CUDA device with Triton, and eagerly everywhere else.

Each is a few elementwise ops and reductions that eager PyTorch runs as several kernels, each writing its result to
memory for the next to read: the vision and LM rotaries, the vision RMSNorm and MLP activation, the cross-entropy's
passes (qvl.kernels.speed_hf_vision, qvl.kernels.speed_rotary, qvl.kernels.speed_cross_entropy). Inductor makes one kernel
each way of each, with fp32 arithmetic in registers; the eager function is the reference the CPU tests compare
bitwise against upstream, and the `gpu` tests compare the compiled one against it within bf16 rounding.

`region(fn, tensor)` is the function to call: `fn` compiled where `runs_compiled(tensor)`, else `fn`. A region that
Dynamo or Inductor cannot compile (a torch or Triton version it was not written against) logs one warning naming it
and runs eagerly from then on, so training goes on at eager speed instead of stopping. `TORCHDYNAMO_DISABLE=1`
(torch's own switch) runs every region eagerly. The step census (benchmarks/compiled_regions.py) counts each region
as the kernels Inductor generates for it.

Inside a CUDA graph capture a region never compiles: compiling launches Triton's autotuning benchmarks and
synchronises, which a capture refuses. It runs the code compiled for it before (the graphs' warm-up runs each
captured pass first, at the same shapes) and, where that code's guards do not hold, the call's eager ops, which the
graph captures as it does any others (torch.compiler's `eager_on_recompile` stance).

Shapes: a region is compiled with every size symbolic (`dynamic=True`: packs differ in length), unless its function is
marked `@first_dim_dynamic`, which keeps every size but the first dimension of each tensor argument static. With
symbolic inner sizes Inductor's kernels split a flat index by sizes known only at run time (integer divisions in
every element); a region that broadcasts over heads or rotates halves of a head (the vision rotary, 480 us per call
on an H100 for ~100 MB, benchmarks/RESULTS.md) pays for them, a flat elementwise one (the MLP activation) does not.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from qvl.foundation import graph_replay

logger = logging.getLogger(__name__)


@functools.cache
def compile_usable() -> bool:
    """Whether Inductor can generate CUDA kernels here (it needs Triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: qvl's compiled regions run eagerly on CUDA")
        return False
    return True


def cuda_compile_usable() -> bool:
    """Whether this machine compiles for CUDA: a CUDA device and Triton."""
    return torch.cuda.is_available() and compile_usable()


def runs_compiled(tensor: torch.Tensor) -> bool:
    """Whether qvl's compiled regions run for a tensor: on CUDA where Triton is, outside an enclosing compile (a
    compiled vision block traces a region's eager math into its own graph)."""
    return tensor.is_cuda and compile_usable() and not torch.compiler.is_compiling()


def first_dim_dynamic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` so that its compiled region takes only its tensor arguments' first dimension (tokens, patches) as
    dynamic, every other size as the constant it is (heads, head dim: divisions by constants in the kernels)."""
    fn.qvl_first_dim_dynamic = True
    return fn


# What a region that cannot be compiled raises: Dynamo's and Inductor's errors, and the plain Exception Dynamo raises
# for a full-graph function compiled more often than its recompile_limit (8 in torch 2.14: a region met at new static
# sizes, dtypes or grad modes, e.g. the rotary at each model's head counts in one process) instead of running it eagerly
COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._inductor.exc.InductorError,
    # (named so since torch 2.7; the GPU image's torch may differ from the pinned one)
    getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException),
)


class CompiledRegion:
    """`fn` compiled as one graph with dynamic shapes (packs differ in length: every size symbolic, or only each
    tensor's first dimension where `fn` is `first_dim_dynamic`); eager from the first failure to compile on, with a
    warning."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.first_dim_only = getattr(fn, "qvl_first_dim_dynamic", False)
        # dynamic=None with the first dimensions marked below: those symbolic, the rest static
        self.graph = torch.compile(fn, dynamic=None if self.first_dim_only else True, fullgraph=True)
        self.eager = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.eager:
            if self.first_dim_only:
                for arg in (*args, *kwargs.values()):
                    if isinstance(arg, torch.Tensor) and arg.dim():
                        torch._dynamo.maybe_mark_dynamic(arg, 0)
            try:
                # inside a capture: the compiled code where its guards hold, else this call's ops eagerly
                capturing = graph_replay.is_capturing()
                with torch.compiler.set_stance("eager_on_recompile") if capturing else contextlib.nullcontext():
                    return self.graph(*args, **kwargs)
            except COMPILE_ERRORS as error:
                self.eager = True
                name = f"{self.fn.__module__}.{self.fn.__qualname__}"
                logger.warning("compiled region %s could not be compiled and runs eagerly: %s", name, error)
        return self.fn(*args, **kwargs)


@functools.cache
def compiled(fn: Callable[..., Any]) -> CompiledRegion:
    """The one compiled region of `fn` in this process."""
    return CompiledRegion(fn)


def region(fn: Callable[..., Any], tensor: torch.Tensor) -> Callable[..., Any]:
    """`fn` as a compiled region where qvl's compiled regions run for `tensor`, else `fn` itself."""
    return compiled(fn) if runs_compiled(tensor) else fn
