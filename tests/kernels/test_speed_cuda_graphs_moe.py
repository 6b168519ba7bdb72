"""speed-cuda-graphs with MoE layers (qvl.kernels.speed_cuda_graphs.moe_graphs): each layer's router and combine
captured as Megatron-Core's partial graphs and its attention as qvl's third graph (local_specs.GraphedAttentionMoELayer),
its experts eager; with grouped experts on one rank the whole MoE block as one graph (qvl.kernels.moe_block_graphs).
Which MoE runs stay eager, and (slow) that tiny Qwen3-VL-MoE trains with the graphs recorded on the CPU as it does
eagerly: in parts on one rank and at TP=2, whole with grouped experts (full training and LoRA on the experts, and
at TP=2 with expert TP 1)."""

from __future__ import annotations

import types

import pytest

from qvl.kernels import speed_cuda_graphs
from tests.kernels.test_speed_cuda_graphs import LAYERS_GRAPHED, _eager_and_graphed, _tiny_run

MOE_PARTIAL = LAYERS_GRAPHED + " (each MoE layer's attention, router and combine; its experts eager)"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"moe_expert_capacity_factor": 1.0}, "MoE layers whose all-to-all dispatcher"),
        ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, None),
        ({"moe_router_padding_for_fp8": True}, "MoE layers whose all-to-all dispatcher"),
        ({"moe_router_padding_for_fp8": True, "moe_token_dispatcher_type": "allgather"}, None),
    ],
)
def test_moe_layers_whose_router_reads_the_host_stay_eager(change, reason):
    """Megatron-Core 0.19.2 captures a MoE layer's router and the all-to-all dispatcher's preprocessing in one graph,
    which it refuses where that preprocessing synchronises with the host (a capacity factor that drops tokens, the
    router's fp8 padding): those keep the layers eager, the rest graph the router and combine."""
    from megatron.core.transformer.enums import CudaGraphModule

    model = types.SimpleNamespace(pipeline_model_parallel_size=1, num_moe_experts=8, moe_layer_freq=1, num_layers=2,
                                  moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None,
                                  moe_pad_expert_input_to_capacity=False, moe_router_padding_for_fp8=False)  # fmt: skip
    vars(model).update(change)
    got = speed_cuda_graphs.eager_layers(types.SimpleNamespace(model=model))
    assert got == reason if reason is None else got.startswith(reason)
    modules = speed_cuda_graphs.layer_graph_settings(model)["cuda_graph_modules"]
    assert modules == [CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
    assert speed_cuda_graphs.layer_graph_settings()["cuda_graph_modules"] == []  # a dense model's whole layers


def test_a_moe_layers_attention_graph_takes_the_pack_without_its_pad_mark():
    """The attention graph's arguments are the same for every pack: a padded pack's mark (where its pad starts, for
    the router) is dropped, its bounds and lengths kept; an unmarked pack and none are passed as they are."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels.fix_moe_pad_tokens import PaddedPack
    from qvl.kernels.local_specs import unmarked_pack

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    marked = PaddedPack(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7, pad_from=9
    )
    plain = unmarked_pack(marked)
    assert type(plain) is PackedSeqParams and not hasattr(plain, "pad_from")
    assert (
        plain.cu_seqlens_q is cu and plain.cu_seqlens_kv is cu and plain.max_seqlen_q == 7 and plain.qkv_format == "thd"
    )
    assert unmarked_pack(plain) is plain and unmarked_pack(None) is None


@pytest.mark.slow
def test_a_moe_model_trains_with_its_routers_and_combines_graphed_as_it_does_eagerly(tmp_path, monkeypatch):
    """Qwen3-VL-MoE with `cuda_graphs=true` (recorded on the CPU): each MoE layer's attention (qvl's
    GraphedAttentionMoELayer), its router (with the all-to-all dispatcher's preprocessing, whose counts come to the host
    in the graph's copies) and its combine are captured forward and backward, the experts between them run eagerly, and
    every pack is padded to seq_length with its pad masked out of the router's balancing loss (the mask one of the
    router graph's inputs; the attention's graph takes the bounds unmarked): the losses are the eager run's, which
    pads nothing. Without the mask the pad shifted them (2e-6 by step 4)."""
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.graph_replay import RecordedGraph

    args = _tiny_run(tmp_path, "qwen3_vl_moe", "qwen3_vl_30b_a3b_pretrain", 4)
    replays, captures = [], []
    replay, capture_end = RecordedGraph.replay, RecordedGraph.capture_end
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(len(self.ops)) or replay(self))
    monkeypatch.setattr(RecordedGraph, "capture_end", lambda self: capture_end(self) or captures.append(self))
    _eager_and_graphed(tmp_path, args, 4, said=MOE_PARTIAL, rel=5e-7)  # bit for bit here; the pad counted: 2.2e-6
    moe_graphs = len(captures) - 2  # the tower's bucket: forward and backward
    # per layer: attention, router and combine, each forward and backward
    assert moe_graphs == 6 * tiny_hf_config("qwen3_vl_moe").text_config.num_hidden_layers
    assert len(replays) == 6 * moe_graphs + 7 * 2  # steps 2 to 4's micro-batches; the tower's also at its capture
    assert all(replays)


@pytest.mark.slow
def test_a_moe_model_at_tensor_parallel_2_trains_with_its_routers_graphed_as_it_does_eagerly(tmp_path):
    """Qwen3-VL-MoE at TP=2 (sequence parallelism), two gloo ranks: the router graphs hold the all-reduce of the
    tokens per expert, and each rank masks its share of a pad that the graphs' padding to seq_length splits unevenly
    (most of it on rank 1); the eager run pads a pack to an even length. The losses agree because a masked router
    weighs its balancing loss by its group's mean count (fix-moe-pad-tokens): with upstream's count, the group's
    total, the padded packs' balancing loss weighed twice and step 3 was 7e-5 (relative) apart."""
    from tests.run_qvl import qvl_on_two_ranks

    args = _tiny_run(tmp_path, "qwen3_vl_moe", "qwen3_vl_30b_a3b_pretrain", 3, "tensor_parallel=2")
    _eager_and_graphed(tmp_path, args, 3, train=qvl_on_two_ranks, said=MOE_PARTIAL, rel=1e-6)


def _scope_changes(monkeypatch) -> list[str]:
    """The modes MoE layers change their graphs' scope to (a layer falling back to the partial graphs: "partial")."""
    from qvl.kernels import local_specs

    changes = []
    scope = local_specs.GraphedAttentionMoELayer.transition_cudagraph_scope
    monkeypatch.setattr(local_specs.GraphedAttentionMoELayer, "transition_cudagraph_scope",
                        lambda self, mode: changes.append(mode) or scope(self, mode))  # fmt: skip
    return changes


MOE_WHOLE = LAYERS_GRAPHED + " (each MoE layer's attention and its whole MoE block, experts included)"


@pytest.mark.slow
@pytest.mark.parametrize("falls_back", [False, True])
def test_a_moe_model_with_grouped_experts_trains_with_its_moe_blocks_graphed_whole(falls_back, tmp_path, monkeypatch,
                                                                                   caplog):  # fmt: skip
    """Qwen3-VL-MoE with `grouped_experts=true cuda_graphs=true` on one rank (recorded on the CPU): each MoE layer's
    whole MoE block (qvl.kernels.moe_block_graphs: router, dispatch, grouped experts, combine) is one graph each way
    and its attention another, so nothing of the layer runs eagerly and the host waits for no router graph; the
    capture refuses any host read, as a device's does. The losses are the eager run's with grouped experts (without
    the pad mask as the block graph's input they were 2e-6 apart by step 4). A layer whose first call finds its
    block cannot be captured whole (`falls_back`: `eager_block` gives a reason) says so and takes Megatron-Core's
    router and combine graphs, with the same losses."""
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.graph_replay import RecordedGraph
    from qvl.kernels import moe_block_graphs

    args = _tiny_run(tmp_path, "qwen3_vl_moe", "qwen3_vl_30b_a3b_pretrain", 4, "grouped_experts=true")
    replays, captures = [], []
    replay, capture_end = RecordedGraph.replay, RecordedGraph.capture_end
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(len(self.ops)) or replay(self))
    monkeypatch.setattr(RecordedGraph, "capture_end", lambda self: capture_end(self) or captures.append(self))
    partial = _scope_changes(monkeypatch)
    if falls_back:
        monkeypatch.setattr(moe_block_graphs, "eager_block", lambda layer, hidden: "a reason")
    _eager_and_graphed(tmp_path, args, 4, said=MOE_WHOLE, rel=5e-7)
    layers = tiny_hf_config("qwen3_vl_moe").text_config.num_hidden_layers
    graphs = 6 if falls_back else 4  # per layer: attention and MoE block, or attention, router and combine; each way
    assert partial == ["partial"] * layers if falls_back else not partial
    assert ("graphs its router and combine apart: a reason" in caplog.text) is falls_back
    assert len(captures) - 2 == graphs * layers  # and the tower's bucket, forward and backward
    assert len(replays) == 6 * graphs * layers + 7 * 2
    assert all(replays)


@pytest.mark.slow
def test_a_moe_model_at_tensor_parallel_2_and_expert_tp_1_trains_with_its_moe_blocks_graphed_whole(tmp_path):
    """Qwen3-VL-MoE at TP=2 (sequence parallelism) with expert TP 1 (`model.expert_tensor_parallel_size=1`) and
    grouped experts, two gloo ranks: the experts are whole on each rank and each rank routes its own share of the
    pack, so the dispatcher is one rank's and each MoE block is one graph each way, as on one GPU. The losses are
    the eager run's."""
    from tests.run_qvl import qvl_on_two_ranks

    args = _tiny_run(tmp_path, "qwen3_vl_moe", "qwen3_vl_30b_a3b_pretrain", 3, "tensor_parallel=2",
                     "grouped_experts=true", "model.expert_tensor_parallel_size=1")  # fmt: skip
    _eager_and_graphed(tmp_path, args, 3, train=qvl_on_two_ranks, said=MOE_WHOLE, rel=1e-6)


@pytest.mark.slow
def test_lora_on_grouped_experts_trains_with_the_moe_blocks_graphed_whole(tmp_path, monkeypatch):
    """Qwen3-VL-MoE LoRA from a converted checkpoint, adapters on the experts too, grouped: the frozen experts' grouped
    GEMMs (no weight gradient) and their adapters' grouped GEMMs inside each layer's MoE block graph, no layer falling
    back; the losses are the eager run's and the adapters export as a peft adapter."""
    from tests.run_qvl import qvl_in_process

    megatron_dir, hf = str(tmp_path / "megatron"), str(tmp_path / "hf")
    args = _tiny_run(tmp_path, "qwen3_vl_moe", "qwen3_vl_30b_a3b_peft", 3, f"pretrained_checkpoint={megatron_dir}",
                     "grouped_experts=true", "adapter_targets=language,vision,merger,experts")  # fmt: skip
    qvl_in_process("convert", "import", hf, megatron_dir, "--dtype", "fp32", "--device", "cpu")
    partial = _scope_changes(monkeypatch)
    _eager_and_graphed(tmp_path, args, 3, said=MOE_WHOLE)
    assert not partial
    exported = qvl_in_process("convert", "export-adapter", str(tmp_path / "graphed"), hf, str(tmp_path / "lora"),
                              "--device", "cpu")  # fmt: skip
    assert exported.rstrip().endswith("OK (tolerance 1e-05)")
