"""The MoE load-balancing loss of a preference step weighted as in SFT (patch group "fix-preference-moe-aux" of
qvl.foundation.patches).

With `calculate_per_token_loss` (every qvl recipe), Megatron-Core 0.19.2's router (`TopKRouter.
attach_and_log_load_balancing_loss`, megatron/core/transformer/moe/router.py ~550-640) multiplies each micro-batch's
load-balancing loss by its token count before the step divides every gradient by the step's count of what the loss
function counted: learned tokens in SFT, so each micro-batch's balancing loss enters with weight 1 / micro-batches
there. A preference step's loss function counts pairs (its loss is the mean over the step's pairs), and the router
would then weigh the balancing loss by tokens / pairs, hundreds of times its SFT weight. While this group is applied
around the policy's forward, a router whose module carries the micro-batch's pair count (set by the step,
`weighted_per_pair`) multiplies by that count instead: each micro-batch's balancing loss enters with weight
pairs / the step's pairs, the coefficient's meaning unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from qvl.foundation import patches

GROUP = "fix-preference-moe-aux"
PAIRS = "qvl_preference_pairs"  # the router attribute holding the micro-batch's pair count while it runs


def counted_in_pairs(original: Callable) -> Callable:
    """Replacement factory for `TopKRouter.attach_and_log_load_balancing_loss`: the token count it multiplies by is
    the micro-batch's pair count where the router carries one."""

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                           *args, **kwargs):  # fmt: skip
        pairs = getattr(self, PAIRS, None)
        if pairs is not None and self.calculate_per_token_loss:
            # upstream multiplies by valid_token_count x the TP x CP group size
            kwargs.pop("valid_token_count", None)
            args = args[:1]  # needs_dp_avg, when given by position
            kwargs["valid_token_count"] = pairs / self.tp_cp_group.size()
        return original(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args, **kwargs)

    return attach_and_log_load_balancing_loss


@contextlib.contextmanager
def weighted_per_pair(model: Any, *, pairs: int) -> Iterator[None]:
    """Around a preference micro-batch's forward: its routers weigh their load-balancing loss by `pairs` (nothing
    for a model without routers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in (model if isinstance(model, list) else [model]) for m in chunk.modules()
               if isinstance(m, TopKRouter)]  # fmt: skip
    if not routers:
        yield
        return
    for router in routers:
        setattr(router, PAIRS, pairs)
    try:
        with patches.applied(GROUP):
            yield
    finally:
        for router in routers:
            delattr(router, PAIRS)
