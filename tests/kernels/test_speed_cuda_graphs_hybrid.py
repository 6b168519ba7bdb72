"""speed-cuda-graphs with Qwen3.5's hybrid layers (slow): tiny Qwen3.5-VL trains with its full-attention layers
graphed whole and its Gated DeltaNet layers' MLPs alone (qvl.kernels.local_specs.GraphedMLPLayer), and
tiny Qwen3.5-VL-MoE with every layer's router and combine graphed (with grouped experts its whole MoE block) and a
full-attention layer's attention (a Gated DeltaNet eager), each as it does eagerly (recorded on the CPU)."""

from __future__ import annotations

import pytest

from tests.kernels.test_speed_cuda_graphs import LAYERS_GRAPHED, _eager_and_graphed, _tiny_run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "recipe", "grouped"),
    [
        ("qwen3_5_vl", "qwen3_5_vl_9b_pretrain", False),
        ("qwen3_5_vl_moe", "qwen3_5_vl_35b_a3b_pretrain", False),
        ("qwen3_5_vl_moe", "qwen3_5_vl_35b_a3b_pretrain", True),
    ],
)
def test_qwen3_5_trains_with_its_layers_graphed_around_its_gated_deltanet_as_it_does_eagerly(
    family, recipe, grouped, tmp_path, monkeypatch
):
    """Every pack is padded to seq_length with zero-length sub-sequences after it (the graphs' fixed shapes), which the
    eager Gated DeltaNets take as they are. Dense: each full-attention layer captured whole and each Gated DeltaNet
    layer's MLP, forward and backward. MoE: each layer's router and combine and each full-attention layer's attention,
    forward and backward; with grouped experts (one rank) each layer's whole MoE block instead of its router and
    combine, its shared expert included (qvl.kernels.moe_block_graphs). The vision tower's bucket too; every graph replays at every later micro-batch, and the
    losses are the eager run's."""
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.graph_replay import RecordedGraph

    layer_types = tiny_hf_config(family).text_config.layer_types
    moe = family.endswith("_moe")
    assert "linear_attention" in layer_types and "full_attention" in layer_types
    full, linear = layer_types.count("full_attention"), layer_types.count("linear_attention")
    # each forward and backward: dense, a full-attention layer whole and a Gated DeltaNet layer's MLP; MoE, every
    # layer's router and combine and a full-attention layer's attention
    layer_graphs = (2 if grouped else 4) * (full + linear) + 2 * full if moe else 2 * (full + linear)
    note = " (each MoE layer's router and combine, and its full attention; Gated DeltaNet and experts eager)"
    if grouped:
        note = " (each MoE layer's whole MoE block, experts included, and its full attention; Gated DeltaNet eager)"
    note = note if moe else " (a Gated DeltaNet layer's MLP alone; its Gated DeltaNet eager)"
    args = _tiny_run(tmp_path, family, recipe, 4, *(["grouped_experts=true"] if grouped else []))
    replays, captures = [], []
    replay, capture_end = RecordedGraph.replay, RecordedGraph.capture_end
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(len(self.ops)) or replay(self))
    monkeypatch.setattr(RecordedGraph, "capture_end", lambda self: capture_end(self) or captures.append(self))
    _eager_and_graphed(tmp_path, args, 4, said=LAYERS_GRAPHED + note, rel=5e-7)
    assert len(captures) == layer_graphs + 2  # and the tower's bucket: forward and backward
    assert len(replays) == 6 * layer_graphs + 7 * 2  # steps 2 to 4's micro-batches; the tower's also at its capture
    assert all(replays)
