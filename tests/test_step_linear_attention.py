"""`benchmarks/step_linear_attention.py`: the step census's stand-ins for flash-linear-attention's kernels, counted as
fla launches them for one Gated DeltaNet call, with the bytes of their tensors at the real widths."""

from __future__ import annotations

import pytest
import torch

from benchmarks import step_linear_attention as fla
from benchmarks.op_costs import WidthMap
from benchmarks.step_census import Census

TINY_HEAD, REAL_HEAD = 20, 128
HEADS, TOKENS = 4, 200
BOUNDS = [0, 70, 200]  # two sub-sequences: 2 + 3 chunks of 64 tokens


def _census() -> Census:
    return Census(WidthMap(dims={TINY_HEAD: REAL_HEAD, HEADS * TINY_HEAD * 3: HEADS * REAL_HEAD * 3}))


def _inputs():
    q, k, v = (torch.randn(1, TOKENS, HEADS, TINY_HEAD, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, TOKENS, HEADS, requires_grad=True)
    beta = torch.rand(1, TOKENS, HEADS, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, g, beta


def test_chunks_follow_each_sub_sequence():
    assert fla.chunks(BOUNDS) == 2 + 3
    assert fla.chunks([0, 64, 128]) == 2
    assert fla.chunks([0, 1]) == 1


def test_the_delta_rule_counts_fla_s_kernels_each_way_with_their_bytes():
    census = _census()
    q, k, v, g, beta = _inputs()
    cu_seqlens = torch.tensor(BOUNDS, dtype=torch.int32)
    kernels = fla.FlaKernels(census)
    with census.tracking(), census.counted():
        out, state = kernels.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens)
        forward = dict(census.counts.launches)
        out.float().sum().backward()
    assert state is None and out.shape == v.shape and out.dtype == v.dtype
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, g, beta))
    assert sum(n for name, n in forward.items() if name.startswith("fla ")) == len(fla.FORWARD) == 6
    launches = census.counts.launches
    assert sum(n for name, n in launches.items() if name.startswith("fla ")) == len(fla.FORWARD) + len(fla.BACKWARD)
    assert launches["fla chunk_gated_delta_rule_fwd_h"] == 2  # again in backward, as fla recomputes the states
    # bytes at the real head width: a [tokens, heads, 128] bf16 tensor per q, k, v-like name; the states per chunk
    nbytes = fla.delta_rule_bytes(tokens=TOKENS, heads=HEADS, key=REAL_HEAD, value=REAL_HEAD, chunk_count=5)
    assert nbytes["h"] == 5 * HEADS * REAL_HEAD * REAL_HEAD * 2 and nbytes["k"] == TOKENS * HEADS * REAL_HEAD * 2
    expected = sum(nbytes[name] for kernel in fla.FORWARD + fla.BACKWARD for name in kernel.reads + kernel.writes)
    fla_bytes = sum(b for name, b in census.counts.nongemm_bytes_by_op.items() if name.startswith("fla "))
    assert fla_bytes == expected


def test_fla_reads_the_bounds_back_once_per_pack_unless_given_its_chunk_list():
    census = _census()
    kernels = fla.FlaKernels(census)
    cu_seqlens = torch.tensor(BOUNDS, dtype=torch.int32)
    with census.tracking(), census.counted():
        for _ in range(3):  # three layers of one pack: fla caches the list by the tensor
            kernels.chunk_gated_delta_rule(*_inputs(), cu_seqlens=cu_seqlens)
        assert sum(census.counts.syncs.values()) == 1
        kernels.causal_conv1d(torch.randn(1, TOKENS, 8), torch.randn(8, 4), activation="silu",
                              cu_seqlens=torch.tensor(BOUNDS), chunk_indices=torch.zeros(5, 2))  # fmt: skip
        assert sum(census.counts.syncs.values()) == 1  # given the list: no read


def test_the_convolution_counts_one_kernel_forward_and_four_backward():
    census = _census()
    kernels = fla.FlaKernels(census)
    x = torch.randn(1, TOKENS, HEADS * TINY_HEAD * 3, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(HEADS * TINY_HEAD * 3, 4, dtype=torch.bfloat16, requires_grad=True)
    with census.tracking(), census.counted():
        y, _ = kernels.causal_conv1d(x[:, :, :], weight, activation="silu", cu_seqlens=torch.tensor(BOUNDS))
        y.float().sum().backward()
    launches = {name: n for name, n in census.counts.launches.items() if name.startswith("fla ")}
    assert launches == {"fla causal_conv1d_fwd": 2, "fla causal_conv1d_bwd": 1, "fla sum (conv dw)": 1,
                        "fla _to_copy (conv dw)": 1}  # fmt: skip
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_calls_fla_is_not_given_in_training_are_refused():
    kernels = fla.FlaKernels(_census())
    with pytest.raises(NotImplementedError, match="training call"):
        kernels.chunk_gated_delta_rule(*_inputs(), output_final_state=True)
