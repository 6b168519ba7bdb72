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
    # the pack's chunk offsets the first time fla meets its cu_seqlens, then the rule's kernels
    assert sum(n for name, n in forward.items() if name.startswith("fla ")) == len(fla.OFFSETS) + len(fla.FORWARD)
    assert (len(fla.OFFSETS), len(fla.FORWARD), len(fla.BACKWARD)) == (6, 6, 10)
    launches = census.counts.launches
    fla_launches = sum(n for name, n in launches.items() if name.startswith("fla "))
    assert fla_launches == len(fla.OFFSETS) + len(fla.FORWARD) + len(fla.BACKWARD)
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
        for _ in range(3):  # three layers of one pack: fla caches the list and the offsets by the tensor
            kernels.chunk_gated_delta_rule(*_inputs(), cu_seqlens=cu_seqlens)
        assert sum(census.counts.syncs.values()) == 1
        assert census.counts.launches["fla prepare_chunk_offsets (cumsum)"] == 1
        kernels.chunk_gated_delta_rule(*_inputs(), cu_seqlens=cu_seqlens.clone())  # the next pack
        assert census.counts.launches["fla prepare_chunk_offsets (cumsum)"] == 2
        assert sum(census.counts.syncs.values()) == 2
        kernels.causal_conv1d(torch.randn(1, TOKENS, 8), torch.randn(8, 4), activation="silu",
                              cu_seqlens=torch.tensor(BOUNDS), chunk_indices=torch.zeros(5, 2))  # fmt: skip
        assert sum(census.counts.syncs.values()) == 2  # given the list: no read


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


# --- on a GPU: the stand-ins' launches are what fla launches, and fla's time against the bytes the census charges


def _profiled_kernels(run) -> tuple[int, float]:
    """(device kernels and memsets launched, their total seconds) of `run()` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), sum(e.device_time_total for e in events) / 1e6


@pytest.mark.gpu
def test_on_the_device_fla_launches_what_the_census_counts_at_qwen3_5_9b_widths(record_property):
    """fla's `chunk_gated_delta_rule` and `causal_conv1d` as Megatron-Core calls them (with the chunk list and host
    bounds qvl's `speed-gated-delta-sync-free` gives), at Qwen3.5-VL-9B's widths and a census pack (5 samples of 780
    tokens and the pad's tail in 4,096): each way, as many device launches as the stand-ins count (a newer fla that
    launches otherwise fails here). Each phase's kernel time and the bandwidth it implies for the census's bytes are
    recorded: the step model times fla by its bytes (benchmarks/step_linear_attention.py)."""
    common = pytest.importorskip("megatron.core.ssm.gated_delta_net.common")
    if not common.HAVE_FLA:
        pytest.skip("needs flash-linear-attention")
    from qvl.kernels.speed_gated_delta_sync_free import chunk_list

    bounds = [0, 780, 1560, 2340, 3120, 3900, 4096]
    host = torch.tensor(bounds, dtype=torch.int32)
    given = {"cu_seqlens_cpu": host, "chunk_indices": chunk_list(host).cuda()}
    tokens, heads, dim, channels = 4096, 32, 128, 2 * 16 * 128 + 32 * 128
    generator = torch.Generator("cuda").manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=generator)).to(dtype).requires_grad_()

    q, k = (torch.nn.functional.normalize(leaf(1, tokens, heads, dim), dim=-1).detach().requires_grad_() for _ in "qk")
    v = leaf(1, tokens, heads, dim)
    g = (-torch.rand(1, tokens, heads, device="cuda", generator=generator)).requires_grad_()  # log-decays, fp32
    beta = torch.rand(1, tokens, heads, device="cuda", generator=generator).to(torch.bfloat16).requires_grad_()
    x, weight = leaf(1, tokens, channels), leaf(channels, 4, scale=0.5)
    # per call: the Function, its inputs, the kernels the census counts for a new pack's first forward and for its
    # backward, and its bytes
    calls = {
        "delta_rule": (lambda cu: common.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **given, cu_seqlens=cu)[0],
                       (q, k, v, g, beta), fla.OFFSETS + fla.FORWARD, fla.BACKWARD,
                       fla.delta_rule_bytes(tokens=tokens, heads=heads, key=dim, value=dim,
                                            chunk_count=fla.chunks(bounds))),
        "conv": (lambda cu: common.causal_conv1d(x=x, weight=weight, activation="silu", **given, cu_seqlens=cu)[0],
                 (x, weight), fla.CONV_FORWARD, fla.CONV_BACKWARD,
                 fla.conv_bytes(tokens=tokens, channels=channels, width=4, chunk_count=fla.chunks(bounds))),
    }  # fmt: skip
    for name, (call, inputs, forward, backward, nbytes) in calls.items():
        for _ in range(2):  # Triton compiles and autotunes at the first calls
            out = call(host.cuda())
            torch.autograd.grad(out, inputs, torch.ones_like(out))
        grad = torch.randn_like(out)
        holder, pack = {}, host.cuda()  # a new pack's bounds: fla has not cached anything of them
        launched = {"forward": _profiled_kernels(lambda: holder.setdefault("out", call(pack)))}
        launched["backward"] = _profiled_kernels(lambda: torch.autograd.grad(holder["out"], inputs, grad))
        for way, kernels in (("forward", forward), ("backward", backward)):
            count, seconds = launched[way]
            charged = sum(nbytes[n] for kernel in kernels for n in kernel.reads + kernel.writes)
            record_property(
                f"fla {name} {way}: launches, seconds, census GB/s", (count, seconds, charged / seconds / 1e9)
            )
            assert count == len(kernels), f"fla {name} {way} launched {count} kernels; the census counts {len(kernels)}"
