"""Patch group "fix-expert-adapter-tp": an expert adapter split over several expert-TP ranks runs qvl's forward,
every other adapter upstream's. On one rank qvl's forward must be upstream's adapter exactly (its sums are over one
rank, its column block is the whole output); at TP=2, where the ranks split the experts, tests/training/
test_train_peft.py compares the LoRA losses with one process's."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import distributed
from qvl.kernels import fix_expert_adapter_tp
from qvl.kernels.fix_expert_adapter_tp import _expert_forward, column_block, split_over_ranks, summed_over_expert_ranks


def _adapter(*, input_is_parallel: bool, is_expert: bool = True):
    from megatron.bridge.peft.utils import ParallelLinearAdapter
    from megatron.core.model_parallel_config import ModelParallelConfig

    name = f"decoder.layers.0.mlp.experts.local_experts.0.linear_fc{2 if input_is_parallel else 1}"
    adapter = ParallelLinearAdapter(
        in_features=6, out_features=4, dim=2, base_linear_name=name, activation="identity", alpha=4,
        input_is_parallel=input_is_parallel, is_expert=is_expert, model_parallel_config=ModelParallelConfig(),
        row_init_method="normal",  # B is zero by default: the output would not show a wrong B
    )  # fmt: skip
    return adapter


@pytest.mark.parametrize("input_is_parallel", [False, True], ids=["linear_fc1", "linear_fc2"])
def test_on_one_rank_qvls_expert_forward_is_upstreams(cpu_runtime, input_is_parallel):
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()
    distributed.init_distributed()
    try:
        adapter = _adapter(input_is_parallel=input_is_parallel)
        x = torch.randn(5, 6)
        outputs, grads = [], []
        for forward in (adapter.forward, lambda v: _expert_forward(adapter, v)):
            adapter.zero_grad()
            out = forward(x)
            (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
            outputs.append(out.detach())
            grads.append([p.grad.clone() for p in adapter.parameters()])
        assert outputs[0].abs().sum() > 0
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert split_over_ranks(adapter) == 1  # one rank: the patched forward calls upstream's
    finally:
        distributed.destroy_distributed()


def test_only_expert_adapters_split_over_several_ranks_leave_upstreams_forward(monkeypatch):
    from types import SimpleNamespace

    calls = []
    forward = summed_over_expert_ranks(lambda self, x: calls.append(x) or "upstream")
    dense = SimpleNamespace(is_expert=False, tp_group=object())
    assert forward(dense, 1) == "upstream" and split_over_ranks(dense) == 1
    whole = SimpleNamespace(is_expert=True, tp_group=None)
    assert forward(whole, 2) == "upstream" and split_over_ranks(whole) == 1
    monkeypatch.setattr(fix_expert_adapter_tp, "split_over_ranks", lambda adapter: 2)
    monkeypatch.setattr(fix_expert_adapter_tp, "_expert_forward", lambda adapter, x: "qvl")
    assert forward(SimpleNamespace(is_expert=True), 3) == "qvl" and calls == [1, 2]


def test_a_rankscolumn_block_lands_in_its_place_and_the_rest_is_zero():
    block = torch.tensor([[1.0, 2.0]])
    assert torch.equal(column_block(block, rank=0, ranks=3), torch.tensor([[1.0, 2.0, 0, 0, 0, 0]]))
    assert torch.equal(column_block(block, rank=2, ranks=3), torch.tensor([[0, 0, 0, 0, 1.0, 2.0]]))
