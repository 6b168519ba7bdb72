"""Patch group "fix-preference-moe-aux": inside a preference step's forward, a router multiplies its load-balancing
loss by the micro-batch's pairs (what the step's loss counts), not its tokens; outside it, upstream's count stays."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from qvl.kernels.fix_preference_moe_aux import PAIRS, counted_in_pairs


def _router(pairs: int | None, tp_cp: int = 2):
    router = SimpleNamespace(calculate_per_token_loss=True, tp_cp_group=SimpleNamespace(size=lambda: tp_cp))
    if pairs is not None:
        setattr(router, PAIRS, pairs)
    return router


def _seen(router, **kwargs) -> dict:
    seen = {}

    def original(self, activation, coeff, aux, name, group, *args, **kw):
        seen.update(args=args, **kw)
        return activation

    counted_in_pairs(original)(router, torch.zeros(3), 0.01, torch.tensor(1.0), "load_balancing_loss", None,
                               **kwargs)  # fmt: skip
    return seen


def test_the_router_counts_the_micro_batchs_pairs_over_its_tp_cp_group():
    # upstream multiplies by valid_token_count x the TP x CP size: pairs / size makes it the pair count
    assert _seen(_router(pairs=3, tp_cp=2), valid_token_count=4096)["valid_token_count"] == 1.5
    assert _seen(_router(pairs=3, tp_cp=1))["valid_token_count"] == 3


def test_without_a_pair_count_upstream_counts_as_before():
    assert _seen(_router(pairs=None), valid_token_count=4096)["valid_token_count"] == 4096
    per_token_off = _router(pairs=3)
    per_token_off.calculate_per_token_loss = False
    assert _seen(per_token_off, valid_token_count=4096)["valid_token_count"] == 4096
