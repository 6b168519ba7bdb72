"""Patch group "speed-grouped-experts": an MoE layer's local experts (Megatron-Core's SequentialMLP, in each MoE
family's tiny model) as two grouped GEMMs give upstream's outputs and gradients: the tokens', the routing weights'
and every expert weight's, also into DDP's `main_grad` and with an expert that gets no token; and upstream's forward
runs wherever the grouped one would not be the same function."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import distributed
from qvl.kernels.speed_grouped_experts import groupable, grouped_experts
from tests.tiny_megatron import tiny_megatron_model


@pytest.fixture(params=["qwen3_vl_moe", "qwen3_5_vl_moe"])
def experts(request, cpu_runtime):
    distributed.init_distributed()
    try:
        from megatron.core.transformer.moe.experts import SequentialMLP

        model, _ = tiny_megatron_model(request.param, gradient_accumulation_fusion=False)
        experts = next(m for m in model.modules() if isinstance(m, SequentialMLP))
        yield experts.requires_grad_(True)  # the tiny model comes frozen (the provider freezes the language model)
    finally:
        distributed.destroy_distributed()


def _routed(experts, dtype=torch.float32, counts=None):
    """Permuted tokens, their counts per local expert (the second gets none) and routing weights."""
    hidden = experts.local_experts[0].linear_fc1.weight.shape[1]
    counts = counts or [3, 0] + [2 + e for e in range(experts.num_local_experts - 2)]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(sum(counts), hidden, generator=generator).to(dtype).requires_grad_()
    probs = torch.rand(sum(counts), generator=generator).requires_grad_()
    return tokens, torch.tensor(counts), probs


def _run(forward, experts, tokens, counts, probs):
    """The output and the gradients of a weighted sum of it: tokens', probs' and each expert weight's."""
    for p in experts.parameters():
        p.grad = None
    tokens.grad = probs.grad = None
    out, bias = forward(experts, tokens, counts, probs)
    assert bias is None
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)).sum().backward()
    return out.detach(), [tokens.grad, probs.grad, *(p.grad for p in experts.parameters())]


def test_grouped_experts_give_upstreams_outputs_and_gradients(experts):
    from megatron.core.transformer.moe.experts import SequentialMLP

    assert experts.num_local_experts >= 2
    tokens, counts, probs = _routed(experts)
    assert groupable(experts, tokens)
    want, want_grads = _run(SequentialMLP.forward, experts, tokens, counts, probs)
    got, got_grads = _run(grouped_experts(SequentialMLP.forward), experts, tokens, counts, probs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want.abs().sum() > 0 and len(got_grads) == len(want_grads) == 2 + 2 * experts.num_local_experts
    for i, (got_grad, want_grad) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert (want_grad.abs().sum() == 0) == (i in (4, 5))  # expert 1 (weights 4 and 5) gets no token
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_weight_gradients_go_into_main_grad_and_ddps_hook_is_told(experts):
    from megatron.core.transformer.moe.experts import SequentialMLP

    tokens, counts, probs = _routed(experts)
    _, want = _run(SequentialMLP.forward, experts, tokens, counts, probs)
    weights = list(experts.parameters())
    for w in weights:
        w.main_grad, w.grad_added_to_main_grad = torch.full_like(w, 0.5), False
    try:
        _run(grouped_experts(SequentialMLP.forward), experts, tokens, counts, probs)
        for w, grad in zip(weights, want[2:], strict=True):
            torch.testing.assert_close(w.main_grad, grad + 0.5, rtol=1e-5, atol=1e-6)
            assert w.grad_added_to_main_grad
    finally:
        for w in weights:
            del w.main_grad, w.grad_added_to_main_grad


def test_in_bf16_the_grouped_experts_are_no_further_from_fp32_than_upstreams(experts):
    from megatron.core.transformer.moe.experts import SequentialMLP

    tokens, counts, probs = _routed(experts)
    exact, _ = _run(SequentialMLP.forward, experts, tokens, counts, probs)
    experts.to(torch.bfloat16)
    low = _routed(experts, torch.bfloat16)
    eager, _ = _run(SequentialMLP.forward, experts, *low)
    grouped, _ = _run(grouped_experts(SequentialMLP.forward), experts, *low)
    error = lambda out: (out.float() - exact).norm() / exact.norm()  # noqa: E731
    assert error(grouped) <= 1.5 * error(eager) + 1e-6, (error(grouped), error(eager))


def test_lora_on_the_experts_grouped_gives_upstreams_outputs_and_adapter_gradients(experts):
    """The tiny model's experts with qvl's LoRA on them (Megatron-Bridge's LoRALinear around each expert linear, B
    drawn so that the adapters change the output): the grouped experts and adapters give upstream's output and every
    adapter factor's gradient; the frozen expert weights get none."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from qvl.bridges.adapters import QvlLoRA

    adapted = QvlLoRA(target_modules=["*.linear_fc1", "*.linear_fc2"], dim=8, alpha=16)(experts, training=True)
    factors = [p for name, p in adapted.named_parameters() if ".adapter." in name]
    assert len(factors) == 4 * adapted.num_local_experts and all(p.requires_grad for p in factors)
    with torch.no_grad():
        for p in factors:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    tokens, counts, probs = _routed(adapted)
    assert groupable(adapted, tokens)
    want, want_grads = _run(SequentialMLP.forward, adapted, tokens, counts, probs)
    got, got_grads = _run(grouped_experts(SequentialMLP.forward), adapted, tokens, counts, probs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        if want_grad is None:  # a frozen expert weight
            assert got_grad is None
            continue
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert sum(g is not None for g in got_grads) == 2 + len(factors)


def test_upstreams_forward_runs_where_the_grouped_one_is_not_the_same_function(experts, monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    calls = []
    forward = grouped_experts(lambda self, *args: calls.append(len(args)) or ("upstream", None))
    tokens, counts, probs = _routed(experts)
    assert forward(experts, tokens.double(), counts, probs) == ("upstream", None)  # float64: no grouped_mm kernel
    assert forward(experts, tokens[:0], torch.zeros_like(counts), probs[:0])[0] == "upstream"  # no token here
    assert forward(experts, tokens.t().contiguous().t(), counts, probs)[0] == "upstream"  # not contiguous
    with monkeypatch.context() as patched:
        patched.setattr(experts.config, "recompute_granularity", "selective")
        patched.setattr(experts.config, "recompute_modules", ["moe_act"])
        assert forward(experts, tokens, counts, probs)[0] == "upstream"
    expert = experts.local_experts[0]
    linear, expert.linear_fc1 = expert.linear_fc1, torch.nn.Identity()  # another module in the linear's place
    try:
        assert not groupable(experts, tokens)
    finally:
        expert.linear_fc1 = linear
    with monkeypatch.context() as patched:
        patched.setattr(experts, "num_local_experts", 1)
        assert not groupable(experts, tokens)
    assert calls == [3, 3, 3, 3] and groupable(experts, tokens)
    assert SequentialMLP.forward is not forward


@pytest.mark.slow
def test_at_real_widths_the_grouped_experts_launch_an_eighth_of_the_kernels_and_read_nothing_back(tmp_path):
    """benchmarks/bench_experts.py (--quick): Qwen3-VL-30B-A3B's 16 local experts at EP=8, forward and backward in
    the step census, weight gradients into main_grad as in training: upstream's SequentialMLP launches 314 kernels
    and reads the token counts back to the host; the grouped experts launch 39 and read nothing."""
    from benchmarks import bench_experts

    results = bench_experts.run(tmp_path, quick=True)
    counts = results["counts"]
    assert counts["sequential"] == {"kernel_launching_ops": 314, "host_syncs": 1}, counts
    assert counts["grouped"] == {"kernel_launching_ops": 39, "host_syncs": 0}, counts
    assert all(check["met"] for check in results["checks"]), results["checks"]


def _bf16_against_fp32(experts, paths: dict) -> tuple[dict, tuple]:
    """Each path's (output, gradients) in bf16 on 4096 routed tokens, each checked no further from the fp32
    sequential experts' than the bf16 sequential experts' (x1.5; frozen weights and the expert that gets no token
    skipped); `experts` are left in bf16. Returns the bf16 results and inputs."""
    from benchmarks import bench_experts

    inputs = bench_experts.routed_tokens(4096, torch.float32, "cuda")
    assert groupable(experts, inputs[0])
    exact, exact_grads = _run(paths["sequential"], experts, *inputs)
    experts.to(torch.bfloat16)
    low = bench_experts.routed_tokens(4096, torch.bfloat16, "cuda")
    results = {name: _run(forward, experts, *low) for name, forward in paths.items()}
    for i, want in enumerate([exact, *exact_grads[2:]]):
        got = {name: [out, *grads[2:]][i] for name, (out, grads) in results.items()}
        if want is None or want.abs().sum() == 0:
            assert all(g is None or g.abs().sum() == 0 for g in got.values())
            continue
        errors = {name: float((g.float() - want).norm() / want.norm()) for name, g in got.items()}
        assert errors["grouped"] <= 1.5 * errors["sequential"] + 1e-3, (i, errors)
    return results, low


@pytest.mark.gpu
def test_on_cuda_bf16_grouped_experts_are_as_close_to_fp32_as_upstreams(record_property):
    """Qwen3-VL-30B-A3B's 16 local experts at EP=8 (benchmarks/bench_experts.py) on CUDA: in bf16 the grouped
    experts' output and weight gradients are no further from the fp32 sequential experts' than the bf16 sequential
    experts' are (x1.5), and their gradients reach `main_grad` as `.grad` would; both paths' forward and backward
    times are recorded (a figure for benchmarks/RESULTS.md, not a test)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from benchmarks import bench_experts

    distributed.init_distributed()  # nccl, one rank
    try:
        paths = {"sequential": SequentialMLP.forward, "grouped": grouped_experts(SequentialMLP.forward)}
        experts = bench_experts.local_experts(torch.float32, "cuda", fused_wgrad=False)
        results, low = _bf16_against_fp32(experts, paths)
        bench_experts.with_main_grads(experts)
        _run(paths["grouped"], experts, *low)
        for weight, grad in zip(experts.parameters(), results["grouped"][1][2:], strict=True):
            torch.testing.assert_close(weight.main_grad, grad.float(), rtol=0, atol=0)
        times = {name: bench_experts.timed(forward, experts, low, 20) for name, forward in paths.items()}
        record_property(
            "forward+backward ms: sequential, grouped", f"{times['sequential']:.3f}, {times['grouped']:.3f}"
        )
    finally:
        distributed.destroy_distributed()


@pytest.mark.gpu
def test_on_cuda_bf16_grouped_lora_experts_are_as_close_to_fp32_as_upstreams():
    """The same 16 local experts with LoRA on their linears (rank 16, B drawn): in bf16 the grouped experts' output
    and adapter gradients are no further from the fp32 sequential ones than the bf16 sequential ones are (x1.5)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from benchmarks import bench_experts
    from qvl.bridges.adapters import QvlLoRA

    distributed.init_distributed()  # nccl, one rank
    try:
        paths = {"sequential": SequentialMLP.forward, "grouped": grouped_experts(SequentialMLP.forward)}
        experts = bench_experts.local_experts(torch.float32, "cuda", fused_wgrad=False)
        experts = QvlLoRA(target_modules=["*.linear_fc1", "*.linear_fc2"], dim=16, alpha=32)(experts, training=True)
        with torch.no_grad():
            for name, p in experts.named_parameters():
                if ".adapter." in name:
                    p.normal_(0, 0.02)
        _bf16_against_fp32(experts, paths)
    finally:
        distributed.destroy_distributed()
