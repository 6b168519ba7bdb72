"""How the forward step pads a pack for the layout (qvl.training.step.padded_length, model_inputs): to seq_length
under pipeline parallelism, to a multiple of the TP size under sequence parallelism (an even split over the ranks),
with one pad sub-sequence that carries no loss and is marked for the MoE router."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qvl.kernels.fix_moe_pad_tokens import PaddedPack
from qvl.training.step import model_inputs, padded_length


def _model(*, pp: int = 1, tp: int = 1, sp: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, sequence_parallel=sp, seq_length=64
    )


@pytest.mark.parametrize(
    ("model", "tokens", "length"),
    [
        (_model(pp=2), 37, 64),  # stages exchange buffers of seq_length
        (_model(pp=2, tp=2, sp=True), 37, 64),
        (_model(tp=2, sp=True), 37, 38),  # each TP rank an equal share
        (_model(tp=4, sp=True), 37, 40),
        (_model(tp=2, sp=True), 36, None),  # already even
        (_model(tp=2), 37, None),  # tensor parallelism alone keeps every token on every rank
        (_model(), 37, None),
    ],
)
def test_a_pack_is_padded_as_its_layout_needs(model, tokens, length):
    assert padded_length(model, tokens) == length


def test_the_pad_is_one_more_sub_sequence_without_loss_marked_where_it_starts():
    lengths = [20, 17]
    tokens = torch.arange(1, 38)[None]
    batch = SimpleNamespace(
        tokens=tokens,
        labels=tokens,
        loss_mask=torch.ones(1, 37),
        position_ids=torch.cat([torch.arange(n) for n in lengths]).expand(3, 1, 37),
        cu_seqlens_q=torch.tensor([0, 20, 37], dtype=torch.int32),
        max_seqlen=20,
    )
    kwargs, loss_mask = model_inputs(batch, torch.device("cpu"), pad_to=padded_length(_model(tp=2, sp=True), 37))
    params = kwargs["packed_seq_params"]
    assert isinstance(params, PaddedPack) and params.pad_from == 37
    assert params.cu_seqlens_q.tolist() == [0, 20, 37, 38]
    assert kwargs["input_ids"].shape == (1, 38) and loss_mask[0, 37] == 0 and loss_mask[0, :37].all()
    assert kwargs["position_ids"][:, 0, 37].tolist() == [0, 0, 0]  # the pad counts from 0, as text does
    unpadded, _ = model_inputs(batch, torch.device("cpu"))
    assert type(unpadded["packed_seq_params"]) is not PaddedPack


@pytest.mark.parametrize(("tokens", "whole_layers", "marked"), [(37, True, None), (37, False, 37), (64, False, 64)])
def test_under_graphs_a_pack_is_marked_only_where_the_layer_calls_are_eager(tokens, whole_layers, marked):
    """Whole-layer graphs take the pack's arguments as they captured them: nothing that differs from pack to pack. A
    MoE layer's partial graphs are called from its eager forward, and the router graph takes the pad's mask: every
    pack says where its pad starts, a full one too (an empty pad: a mask of one shape for every call)."""
    from qvl.kernels.speed_cuda_graphs import GraphShapes

    batch = SimpleNamespace(
        tokens=torch.arange(1, tokens + 1)[None],
        labels=torch.arange(1, tokens + 1)[None],
        loss_mask=torch.ones(1, tokens),
        position_ids=torch.arange(tokens).expand(3, 1, tokens),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        max_seqlen=tokens,
    )
    shapes = GraphShapes(tokens=64, slots=3, max_seqlen=64, whole_layers=whole_layers)
    kwargs, _ = model_inputs(batch, torch.device("cpu"), graph_shapes=shapes)
    params = kwargs["packed_seq_params"]
    assert kwargs["input_ids"].shape == (1, 64) and params.cu_seqlens_q.shape == (4,)
    assert getattr(params, "pad_from", None) == marked and isinstance(params, PaddedPack) == (marked is not None)
