"""Patch group "speed-sync-save": a synchronous torch_dist save reports its writes through an in-process queue
instead of a spawned multiprocessing manager, and the checkpoint loads back bit for bit."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import patches
from qvl.kernels import speed_sync_save, switch
from qvl.kernels.switch import Target


@pytest.fixture
def one_rank(cpu_runtime):
    from qvl.foundation import distributed

    distributed.init_distributed()
    yield
    distributed.destroy_distributed()


def _save_and_load(directory) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    directory.mkdir()
    weights = {"w": torch.arange(48.0).reshape(6, 8), "b": torch.linspace(-1, 1, 5)}
    sharded = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in weights.items()}
    dist_checkpointing.save(sharded, str(directory))
    empty = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=0) for k, v in weights.items()}
    loaded = dist_checkpointing.load(empty, str(directory))
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_synchronous_save_starts_no_manager_and_loads_back_bit_for_bit(one_rank, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a new process: upstream would spawn here
    with patches.applied(speed_sync_save.GROUP):
        _save_and_load(tmp_path / "patched")
    assert filesystem_async._results_queue is None  # upstream's manager was never started
    assert not patches.is_applied(speed_sync_save.GROUP)


def test_the_switch_leaves_an_asynchronous_save_to_upstream():
    assert speed_sync_save.GROUP in switch.training_groups(Target(device="cuda", async_save=False))
    assert speed_sync_save.GROUP not in switch.training_groups(Target(device="cuda", async_save=True))
    assert speed_sync_save.GROUP in switch.training_groups(Target(device="cpu", async_save=False))


def test_a_configs_async_save_decides():
    from types import SimpleNamespace

    config = lambda on: SimpleNamespace(model=SimpleNamespace(), checkpoint=SimpleNamespace(async_save=on))  # noqa: E731
    assert Target.of(config(False), device="cuda").async_save is False
    assert speed_sync_save.GROUP not in switch.training_groups(Target.of(config(True), device="cuda"))
