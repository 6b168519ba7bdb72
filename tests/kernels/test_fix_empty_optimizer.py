"""Patch group "fix-empty-optimizer": a chained optimizer loses the members that train nothing on every rank, and
keeps the rest as they are (at EP=2 and TP=2 with adapters on MoE experts alone, tests/training/test_train_peft.py
saves and resumes such a run)."""

from __future__ import annotations

from types import SimpleNamespace

from qvl.foundation import distributed
from qvl.kernels.fix_empty_optimizer import dropping_empty_members, empty_everywhere, without_empty_members


def _member(*, stub: bool) -> SimpleNamespace:
    return SimpleNamespace(is_stub_optimizer=stub, config="one config", model_chunks=[])


def test_a_member_that_trains_nothing_leaves_the_chain(cpu_runtime):
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()
    from megatron.core.optimizer import ChainedOptimizer

    dense, experts = _member(stub=True), _member(stub=False)
    chain = dropping_empty_members(lambda **kwargs: ChainedOptimizer([dense, experts]))(config=None)
    assert isinstance(chain, ChainedOptimizer) and chain.chained_optimizers == [experts]
    assert not chain.is_stub_optimizer
    for members in ([_member(stub=False), _member(stub=False)], [_member(stub=True), _member(stub=True)], [dense]):
        whole = ChainedOptimizer(members)
        assert without_empty_members(whole) is whole  # nothing empty, nothing left, or one member: as it is
    single = _member(stub=False)
    assert without_empty_members(single) is single  # not a chain


def test_whether_a_member_is_empty_is_asked_of_every_rank(cpu_runtime):
    members = [_member(stub=True), _member(stub=False)]
    assert empty_everywhere(members) == [True, False]  # no process group: this rank's answer
    distributed.init_distributed()
    try:
        assert empty_everywhere(members) == [True, False]  # one rank: the all-reduce's minimum is its own
    finally:
        distributed.destroy_distributed()
