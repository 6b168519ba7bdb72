"""Patch group "speed-gated-delta-sync-free": Gated DeltaNet layers check a pack's bounds on the host values the step
gives and hand fla its chunk list, reading nothing back; the numbers are upstream's, bit for bit (tiny Qwen3.5-VL,
fp32 on the CPU). On a GPU with fla: no synchronisation at all in a layer's forward and backward (torch's sync debug
mode), where upstream's path synchronises."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation import distributed, patches
from qvl.kernels import speed_gated_delta_sync_free as gated_delta
from qvl.kernels.speed_gated_delta_sync_free import GROUP, HostBoundsCuSeqlens, chunk_list, with_host_bounds
from qvl.kernels.speed_rotary import WholePackCuSeqlens
from tests.kernels.test_fix_moe_pad_tokens import _text_pack
from tests.tiny_megatron import tiny_megatron_model

# what reads a device value back to the host: `.item()` and Python numbers (`int()`, `bool()`), and torch.equal
_READS = ("_local_scalar_dense", "is_nonzero", "equal")


class Reads(TorchDispatchMode):
    """Counts the aten ops that read a tensor's values back to the host (on the CPU: that would)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _READS:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _marked(bounds: list[int]) -> HostBoundsCuSeqlens:
    host = torch.tensor(bounds, dtype=torch.int32)
    return with_host_bounds(host.clone(), host, chunk_list(host))


def test_the_chunk_list_is_flas_for_every_sub_sequence_in_order():
    # lengths 3, 67, 0, 128, 1: one chunk, two, none, two, one (fla's prepare_chunk_indices at 64)
    listed = chunk_list(torch.tensor([0, 3, 70, 70, 198, 199], dtype=torch.int32))
    assert listed.dtype == torch.int32
    assert listed.tolist() == [[0, 0], [1, 0], [1, 1], [3, 0], [3, 1], [4, 0]]
    bounds = torch.tensor([0, 1, 65, 65, 300, 4096], dtype=torch.int64)
    expected = [[n, c] for n, (a, b) in enumerate(zip(bounds, bounds[1:])) for c in range(-(-int(b - a) // 64))]
    assert chunk_list(bounds).tolist() == expected and chunk_list(bounds).dtype == torch.int64
    assert chunk_list(bounds, chunk=16).shape[0] == sum(-(-int(b - a) // 16) for a, b in zip(bounds, bounds[1:]))


def test_the_bounds_keep_their_host_values_through_copies_and_compare_on_the_host():
    cu = _marked([0, 5, 12])
    assert isinstance(cu, WholePackCuSeqlens) and cu.bounds == (0, 5, 12)
    for copy in (cu.clone(), cu.detach(), torch.clone(cu)):
        assert isinstance(copy, HostBoundsCuSeqlens) and copy.bounds == cu.bounds and copy.chunks is cu.chunks
    assert type(cu + 0) is torch.Tensor and type(cu[-1:]) is torch.Tensor  # any other op: a plain tensor
    with Reads() as reads:
        assert torch.equal(cu, cu.clone()) and cu.equal(cu)
        assert not torch.equal(cu, _marked([0, 4, 12]))
    assert not reads.counts, "two marked bounds compare their host values"
    with Reads() as reads:
        assert torch.equal(cu, torch.tensor([0, 5, 12], dtype=torch.int32))  # a plain tensor: torch's compare
    assert reads.counts["equal"] == 1
    with pytest.raises(ValueError, match="on the host"):
        with_host_bounds(cu, torch.empty(3, device="meta"), cu.chunks)


def test_the_layers_checks_run_on_the_host_and_a_failed_one_raises_upstreams_error():
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    upstream = _GDNBase._resolve_cu_seqlens
    resolve = gated_delta.checked_on_host(upstream)
    cu = _marked([0, 6, 10, 16])
    with Reads() as reads:
        assert resolve(None, None, cu, 16, "cu_seqlens_q") is cu
        assert resolve(None, None, cu, 16, "cu_seqlens_q", cp_size=2) is cu
    assert not reads.counts
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=16 does not match total_sequence_length=32"):
        resolve(None, None, cu, 32, "cu_seqlens_q")
    with pytest.raises(ValueError, match="divisible by cp_size=4"):
        resolve(None, None, cu, 16, "cu_seqlens_q", cp_size=4)
    with Reads() as reads:  # plain bounds: upstream's checks, each a read
        plain = torch.tensor([0, 6, 10, 16], dtype=torch.int32)
        assert resolve(None, None, plain, 16, "cu_seqlens_q") is plain
    assert sum(reads.counts.values()) == 2


def test_flas_kernels_are_given_the_host_bounds_and_the_chunk_list():
    calls = []

    def fla_kernel(x, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):  # fla 0.6's names
        calls.append({"cu_seqlens": cu_seqlens, "activation": activation, "cu_seqlens_cpu": cu_seqlens_cpu,
                      "chunk_indices": chunk_indices})  # fmt: skip
        calls[-1] = {name: value for name, value in calls[-1].items() if value is not None}
        return "out"

    kernel = gated_delta.given_chunks(fla_kernel)
    cu = _marked([0, 70, 100])
    assert kernel("x", activation="silu", cu_seqlens=cu) == "out"
    assert calls[-1]["cu_seqlens_cpu"] is cu.host and calls[-1]["chunk_indices"] is cu.chunks
    assert calls[-1]["cu_seqlens"] is cu and calls[-1]["activation"] == "silu"
    for plain in (torch.tensor([0, 70, 100]), None):
        kernel("x", cu_seqlens=plain)
        assert calls[-1].keys() <= {"cu_seqlens"}
    older = gated_delta.given_chunks(lambda x, cu_seqlens=None: calls.append({"cu_seqlens": cu_seqlens}))
    older("x", cu_seqlens=cu)  # a kernel without the two arguments (fla before 0.6) is called as upstream calls it
    assert calls[-1] == {"cu_seqlens": cu}


@pytest.mark.parametrize("pad_to", [None, 96])
def test_a_qwen3_5_step_reads_nothing_back_in_its_gated_deltanet_layers_and_gives_upstreams_numbers(
    pad_to, cpu_runtime, monkeypatch
):
    """The step's bounds (padded or not, as pipeline parallelism pads them) through the tiny model's Gated DeltaNet
    layers: upstream's path reads five values back per layer; with the group, none, and the logits and every
    gradient are the same to the bit."""
    from qvl.kernels import torch_gated_delta
    from qvl.training.step import model_inputs

    reads = Reads()
    layer_forward = torch_gated_delta.GatedDeltaNet.forward

    def counted(self, *args, **kwargs):
        with reads:
            return layer_forward(self, *args, **kwargs)

    monkeypatch.setattr(torch_gated_delta.GatedDeltaNet, "forward", counted)
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model("qwen3_5_vl", gradient_accumulation_fusion=False)
        layers = [m for m in model.modules() if isinstance(m, torch_gated_delta.GatedDeltaNet)]
        assert layers, "the tiny Qwen3.5-VL has Gated DeltaNet layers"
        special = (hf_config.image_token_id, hf_config.video_token_id, hf_config.vision_start_token_id)
        batch = _text_pack([23, 17, 30], max(special) + 1, hf_config.text_config.vocab_size)

        def step():
            reads.counts.clear()
            model.zero_grad(set_to_none=True)
            kwargs, _ = model_inputs(batch, torch.device("cpu"), pad_to=pad_to)
            bounds = kwargs["packed_seq_params"].cu_seqlens_q
            logits = model(**{k: v for k, v in kwargs.items() if k not in ("labels", "loss_mask")})
            logits = logits[0] if isinstance(logits, tuple) else logits
            logits[..., :70, :].square().mean().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            return type(bounds), logits.detach(), grads, dict(reads.counts)

        kind, logits, grads, counts = step()
        assert kind is WholePackCuSeqlens and counts == {"_local_scalar_dense": 4 * len(layers), "equal": len(layers)}
        with patches.applied(GROUP):
            marked_kind, marked_logits, marked_grads, marked_counts = step()
        assert marked_kind is HostBoundsCuSeqlens and marked_counts == {}
        assert torch.equal(marked_logits, logits)
        assert marked_grads.keys() == grads.keys()
        assert all(torch.equal(marked_grads[name], grad) for name, grad in grads.items())
    finally:
        distributed.destroy_distributed()


@pytest.mark.gpu
def test_on_a_gpu_with_fla_a_layers_forward_and_backward_never_synchronise():
    """CUDA with flash-linear-attention: every Gated DeltaNet layer of the tiny Qwen3.5-VL (built with the group
    applied, as a training loop builds it), forward and backward on a marked pack, under torch's sync debug mode set
    to raise; the same pack's plain bounds synchronise (the check can fail); both give the same numbers, and fla's
    own chunk list equals the host's. So do the bounds of a graphed run (speed-cuda-graphs: zero-length sub-sequences
    after the last, between which Qwen3.5-VL's Gated DeltaNet layers run eagerly)."""
    pytest.importorskip("fla")
    from fla.ops.utils.index import prepare_chunk_indices
    from megatron.core.packed_seq_params import PackedSeqParams

    from qvl.kernels import torch_gated_delta
    from qvl.kernels.speed_cuda_graphs import fixed_size_cu_seqlens
    from qvl.training.step import device_bounds

    assert torch_gated_delta.fla_usable(), "fla installed but its kernels cannot run here"
    device = torch.device("cuda")
    host = torch.tensor([0, 300, 301, 700, 1024], dtype=torch.int32)
    assert torch.equal(prepare_chunk_indices(host.to(device), 64).cpu(), chunk_list(host))
    distributed.init_distributed()
    try:
        with patches.applied(GROUP):
            model, _ = tiny_megatron_model("qwen3_5_vl", gradient_accumulation_fusion=False)
            layers = [m.to(device) for m in model.modules() if isinstance(m, torch_gated_delta.GatedDeltaNet)]
            marked = device_bounds(host, device)
            plain = host.to(device)
            hidden = torch.randn(1024, 1, layers[0].config.hidden_size, device=device)

            def run(cu, debug: str):
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=400,
                                         max_seqlen_kv=400)  # fmt: skip
                outs = []
                for layer in layers:
                    x = hidden.clone().requires_grad_(True)
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode(debug)
                    try:
                        out, _ = layer(x, attention_mask=None, packed_seq_params=params)
                        out.float().square().sum().backward()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    outs += [out.detach(), x.grad]
                return outs

            assert isinstance(marked, HostBoundsCuSeqlens)
            reference = run(plain, "default")  # also the kernels' first calls (Triton's autotuning synchronises)
            assert all(torch.equal(a, b) for a, b in zip(run(marked, "error"), reference, strict=True))
            graphed = device_bounds(fixed_size_cu_seqlens(host, slots=6), device)  # two zero-length tails
            assert graphed.bounds == (0, 300, 301, 700, 1024, 1024, 1024)
            run(graphed, "default")  # more sub-sequences: the kernels' autotuning may run again (and synchronise)
            assert all(torch.equal(a, b) for a, b in zip(run(graphed, "error"), reference, strict=True))
            with pytest.raises(RuntimeError, match="synchroniz"):
                run(plain, "error")
    finally:
        distributed.destroy_distributed()


def test_the_step_marks_the_bounds_only_where_the_group_is_applied():
    from qvl.training.step import device_bounds

    host = torch.tensor([0, 3, 70], dtype=torch.int32)
    assert type(device_bounds(host, torch.device("cpu"))) is WholePackCuSeqlens
    with patches.applied(GROUP):
        cu = device_bounds(host, torch.device("cpu"))
    assert isinstance(cu, HostBoundsCuSeqlens) and cu.bounds == (0, 3, 70) and cu.host is host
    assert cu.chunks.tolist() == [[0, 0], [1, 0], [1, 1]]
