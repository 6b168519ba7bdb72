"""Gated DeltaNet's input preparation as one compiled region on CUDA (patch group "speed-gated-delta-l2norm" of
qvl.foundation.patches).

Megatron-Core 0.19.2 prepares the gated delta rule's inputs in `_GDNBase._prepare_input_for_gated_delta_rule`
(megatron/core/ssm/gated_delta_net/common.py) under its `jit_fuser`, which is `torch.compile`: the split of the
projected q/k/v, their reshape, the l2norm of q and k, the repeat of q and k for grouped heads and the copies to
contiguous memory, meant as one fused kernel each way. The l2norm is flash-linear-attention's
(`fla.modules.l2norm.l2norm`). In fla 0.6 that function's forward and backward launch through fla's backend
dispatch (`fla.backends.dispatch`), which wraps them in `torch.compiler.disable` ("runtime backend selection must
stay outside torch.compile graphs"). Dynamo cannot put a disabled function in a graph, so the region breaks in two
around the norm. Traced on the CPU with fla 0.6.0's own module, Dynamo reports "Skip calling
`torch.compiler.disable()`d function" for `l2norm_fwd` (on CUDA it may stop earlier in the same call, at the
`torch.cuda.device` context fla's `input_guard` enters). Each way, every Gated DeltaNet layer call then launches the first graph's kernel, fla's
norm kernel and the second graph's kernels. q and k are written out between them and read back, and the host runs
two compiled frames' guards instead of one.

With the group applied, the region's l2norm is torch's (`qvl.kernels.torch_gated_delta.l2norm`: fp32 inside and
the input's dtype out, as fla's kernel computes it). Inductor fuses it into the region's kernels. fla's
`chunk_gated_delta_rule` and `causal_conv1d` stay as they are: Megatron-Core calls them outside compiled code.
"""

from __future__ import annotations

from collections.abc import Callable

from qvl.kernels import torch_gated_delta

GROUP = "speed-gated-delta-l2norm"


# Replacement factory for patch group "speed-gated-delta-l2norm" (qvl.foundation.patches).
def fused_l2norm(original: Callable | None) -> Callable:
    """fla's l2norm, as Megatron-Core's input preparation calls it -> torch's, which that compiled region fuses."""
    return torch_gated_delta.l2norm
