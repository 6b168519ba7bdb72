"""One MoE layer's local experts, forward and backward, as Megatron-Core's SequentialMLP runs them without TE and as
patch group "speed-grouped-experts" runs them: kernel-launching ops and host syncs (the step census's counts), and
on a GPU the time.

The shapes are Qwen3-VL-30B-A3B's (hidden 2048, expert width 768, 128 experts, top-8) at EP=8: 16 local experts per
rank, which get a 4k pack's routed tokens (4096 x 8 / 8 = 4096 tokens; 1024 with --quick), unevenly, one expert
none. The census counts every aten op that launches a kernel on a CUDA device (views and empty tensors excluded) and
every read of a device value on the host; both are properties of the code path, the same on CPU as on a GPU. The
goals: the grouped experts launch at most a quarter of SequentialMLP's kernels, read nothing back to the host, and
compute the same function (fp32 output within 1e-5 of SequentialMLP's). The time needs a GPU (not measured on CPU).
"""

from __future__ import annotations

import json
import pathlib
import time

import torch
import torch.nn.functional as F

from benchmarks.op_costs import WidthMap
from benchmarks.step_census import Census

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K, EXPERT_PARALLEL, PACK = 2048, 768, 128, 8, 8, 4096
LOCAL_EXPERTS = EXPERTS // EXPERT_PARALLEL
GOAL_LAUNCH_RATIO = 0.25


def local_experts(dtype: torch.dtype, device: str, *, fused_wgrad: bool = True):
    """A SequentialMLP of LOCAL_EXPERTS Qwen3-VL-30B-A3B experts (SwiGLU, no bias), as a non-TE model builds it;
    `fused_wgrad`: weight gradients into `main_grad` in the GEMM (qvl's torch-wgrad-accum, as in training), else into
    `.grad`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=16, ffn_hidden_size=6144, moe_ffn_hidden_size=EXPERT_WIDTH,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, params_dtype=dtype, use_cpu_initialization=device == "cpu",
        bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=fused_wgrad,
    )  # fmt: skip
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = SequentialMLP(
        LOCAL_EXPERTS, config, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    return experts.to(device)


def routed_tokens(tokens: int, dtype: torch.dtype, device: str, seed: int = 0):
    """`tokens` permuted tokens spread unevenly over the local experts (the first gets none), counts and weights."""
    generator = torch.Generator().manual_seed(seed)
    shares = torch.rand(LOCAL_EXPERTS, generator=generator) + 0.2
    shares[0] = 0
    counts = (shares / shares.sum() * tokens).long()
    counts[-1] += tokens - counts.sum()
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(dtype=dtype, device=device).requires_grad_()
    probs = torch.rand(tokens, generator=generator).to(device).requires_grad_()
    return hidden, counts.to(device), probs


def step(forward, experts, hidden, counts, probs) -> torch.Tensor:
    out, _ = forward(experts, hidden, counts, probs)
    out.float().square().mean().backward()
    return out.detach()


def with_main_grads(experts) -> None:
    """fp32 `main_grad`s on the experts' weights, as Megatron-Core's DDP gives them in training."""
    for weight in experts.parameters():
        weight.grad = None
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        weight.grad_added_to_main_grad = False


def census(forward, experts, inputs) -> dict:
    """The census's counts of one forward and backward, weight gradients into `main_grad` as in training (the
    sequential path's linears add theirs in the GEMM, on CPU with the CUDA kernel's count)."""
    from qvl.kernels.torch_wgrad_accum import cpu_mixed_precision_addmm

    with_main_grads(experts)
    counted = Census(WidthMap(dims={}))
    with cpu_mixed_precision_addmm(), counted.tracking(), counted.counted():
        step(forward, experts, *inputs)
    summary = counted.regions[counted.region].summary()
    return {key: summary[key] for key in ("kernel_launching_ops", "host_syncs")}


def timed(forward, experts, inputs, repeats: int) -> float:
    step(forward, experts, *inputs)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step(forward, experts, *inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    from qvl.foundation import distributed, megatron, runtime
    from qvl.kernels import torch_wgrad_accum
    from qvl.kernels.speed_grouped_experts import grouped_experts

    cuda = torch.cuda.is_available()
    if not cuda:
        runtime.activate(force=True)
    megatron.import_megatron_bridge()  # with its stand-ins for what is not installed, before Megatron-Core's modules
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch_wgrad_accum.provide_kernels()
    distributed.init_distributed()
    tokens = PACK * TOP_K // EXPERT_PARALLEL // (4 if quick else 1)
    paths = {"sequential": SequentialMLP.forward, "grouped": grouped_experts(SequentialMLP.forward)}
    try:
        experts = local_experts(torch.float32, "cuda" if cuda else "cpu")
        inputs = routed_tokens(tokens, torch.float32, "cuda" if cuda else "cpu")
        with_main_grads(experts)
        outputs = {name: step(forward, experts, *inputs) for name, forward in paths.items()}
        difference = float((outputs["grouped"] - outputs["sequential"]).abs().max() / outputs["sequential"].abs().max())
        experts = experts.to(torch.bfloat16)
        inputs = routed_tokens(tokens, torch.bfloat16, "cuda" if cuda else "cpu")
        counts = {name: census(forward, experts, inputs) for name, forward in paths.items()}
        times = {f"{name}_ms": round(timed(forward, experts, inputs, 5 if quick else 20), 3) for name, forward in paths.items()} if cuda else {}  # fmt: skip
    finally:
        distributed.destroy_distributed()
        if not cuda:
            runtime.deactivate()
    ratio = counts["grouped"]["kernel_launching_ops"] / counts["sequential"]["kernel_launching_ops"]
    results = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (counts only)",
        "shape": {"hidden": HIDDEN, "expert_width": EXPERT_WIDTH, "local_experts": LOCAL_EXPERTS, "tokens": tokens},
        "counts": counts,
        "times": times or "needs a CUDA GPU",
        "relative_max_difference_fp32": difference,
        "checks": [
            {"figure": "kernel-launching ops, grouped / sequential (fwd+bwd)", "value": round(ratio, 3),
             "goal": f"<= {GOAL_LAUNCH_RATIO}", "met": ratio <= GOAL_LAUNCH_RATIO},
            {"figure": "host syncs, grouped (fwd+bwd)", "value": counts["grouped"]["host_syncs"], "goal": "0",
             "met": counts["grouped"]["host_syncs"] == 0},
            {"figure": "fp32 output, max |grouped - sequential| / max |sequential|", "value": f"{difference:.1e}",
             "goal": "<= 1e-5", "met": difference <= 1e-5},
        ],
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_experts.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run)
