"""A MoE layer's whole MoE block as one CUDA graph each way (qvl.kernels.moe_block_graphs): which runs ask for it,
which layers can take it at their first call and why the others cannot. Training with it, and a layer that falls
back to Megatron-Core's partial graphs, run in tests/kernels/test_speed_cuda_graphs_moe.py (slow)."""

from __future__ import annotations

import types

import pytest
import torch

from qvl.foundation import patches
from qvl.kernels.moe_block_graphs import GROUPED, ONE_RANK, eager_block, whole_moe_blocks
from qvl.kernels.speed_grouped_experts import reads_nothing_back


def _model(**change):
    model = types.SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=1,
                                  expert_tensor_parallel_size=None, tensor_model_parallel_size=1,
                                  moe_expert_capacity_factor=None, moe_router_padding_for_quantization=False,
                                  moe_router_padding_for_fp8=False, moe_shared_expert_overlap=False)  # fmt: skip
    vars(model).update(change)
    return model


@pytest.mark.parametrize(
    "change",
    [
        {"num_moe_experts": None},
        {"moe_token_dispatcher_type": "allgather"},
        {"expert_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2},  # the experts' TP is the model's where not set apart
        {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
        {"moe_expert_capacity_factor": 1.0},
        {"moe_router_padding_for_quantization": True},
        {"moe_router_padding_for_fp8": True},
        {"moe_shared_expert_overlap": True},
    ],
)
def test_only_a_one_rank_dropless_run_with_grouped_experts_asks_for_whole_moe_blocks(change, cpu_runtime):
    with patches.applied(GROUPED, ONE_RANK):
        assert whole_moe_blocks(_model()) and not whole_moe_blocks(_model(**change))
        assert whole_moe_blocks(_model(tensor_model_parallel_size=2, expert_tensor_parallel_size=1))
    with patches.applied(ONE_RANK):  # the run did not ask for grouped experts
        assert not whole_moe_blocks(_model())
    with patches.applied(GROUPED):
        assert not whole_moe_blocks(_model())


def test_a_layer_takes_its_whole_block_only_where_its_experts_group_without_a_host_read(cpu_runtime):
    """Qwen3-VL-MoE's tiny MoE layer: on one rank its block can be captured whole for tokens of its weights' dtype;
    tokens of another dtype (no grouped GEMM of the same function), a dispatcher over two expert-parallel ranks and
    experts that are not Megatron-Core's SequentialMLP each give their reason."""
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    from qvl.foundation import distributed
    from tests.tiny_megatron import tiny_megatron_model

    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model("qwen3_vl_moe", gradient_accumulation_fusion=False)
        layer = next(m for m in model.modules() if isinstance(m, MoETransformerLayer))
        dtype = layer.mlp.experts.local_experts[0].linear_fc1.weight.dtype
        hidden = torch.zeros(16, 1, layer.config.hidden_size, dtype=dtype)
        assert eager_block(layer, hidden) is None
        assert "grouped GEMMs" in eager_block(layer, hidden.double())
        dispatcher = layer.mlp.token_dispatcher
        dispatcher.ep_size = 2
        try:
            assert "spreads tokens over ranks" in eager_block(layer, hidden)
        finally:
            dispatcher.ep_size = 1
        experts = layer.mlp.experts
        layer.mlp.experts = torch.nn.Identity()
        try:
            assert "not Megatron-Core's SequentialMLP" in eager_block(layer, hidden)
        finally:
            layer.mlp.experts = experts
    finally:
        distributed.destroy_distributed()


def test_the_grouped_gemm_reads_nothing_back_on_the_cpu_and_is_not_trusted_elsewhere_by_default():
    """The CPU kernel takes the groups' ends as a tensor; a device that is neither the CPU nor CUDA is not assumed
    to (CUDA's answer, bf16 on SM90/SM100 only, needs a GPU: aten's fallback copies the ends to the host)."""
    assert reads_nothing_back(torch.zeros(2, 4)) and reads_nothing_back(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not reads_nothing_back(torch.zeros(2, 4, device="meta", dtype=torch.bfloat16))
