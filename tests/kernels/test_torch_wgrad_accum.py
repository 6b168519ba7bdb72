"""Weight gradients accumulated into `main_grad` inside the GEMM (qvl.kernels.torch_wgrad_accum): torch's stand-in for Apex's
kernel, the HF vision tower's `MainGradLinear`, and a tiny Qwen2.5-VL trained through Megatron-Core's DDP with the
fusion on and off (fp32, CPU): the same losses and `main_grad`s up to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation import patches
from qvl.kernels import torch_wgrad_accum
from qvl.kernels.torch_wgrad_accum import MainGradLinear, accumulate_wgrad

STEPS, MICRO_BATCHES, LR = 3, 2, 0.5


def _linears(seed: int = 0, width_in: int = 64, width_out: int = 96) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """An `nn.Linear` and a `MainGradLinear` with the same weights; the second with a DDP-style main_grad."""
    torch.manual_seed(seed)
    plain = torch.nn.Linear(width_in, width_out)
    fused = torch.nn.Linear(width_in, width_out)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = MainGradLinear
    fused.weight.main_grad = torch.zeros_like(fused.weight)
    fused.weight.grad_added_to_main_grad = False
    return plain, fused


def test_main_grad_linear_equals_nn_linear_and_accumulates_into_main_grad():
    """Forward and input gradient bit for bit; the weight gradient summed over micro-batches into main_grad within
    fp32 rounding (the GEMM adds into main_grad block by block: the same sums, another order); the bias and the
    first micro-batch's weight gradient (added to zeros) bit for bit here."""
    plain, fused = _linears()
    unfused_main_grad = torch.zeros_like(plain.weight)
    for micro_batch in range(3):
        x = torch.randn(512, 64, requires_grad=True)
        x_fused = x.detach().clone().requires_grad_()
        grad = torch.randn(512, 96)
        out, out_fused = plain(x), fused(x_fused)
        assert torch.equal(out_fused, out)
        out.backward(grad)
        out_fused.backward(grad)
        assert torch.equal(x_fused.grad, x.grad)
        assert torch.equal(fused.bias.grad, plain.bias.grad)
        unfused_main_grad += plain.weight.grad  # what Megatron-Core's DDP hook does with .grad
        assert fused.weight.grad_added_to_main_grad  # so the hook skips its add
        if micro_batch == 0:
            assert torch.equal(fused.weight.main_grad, unfused_main_grad)
        plain.weight.grad = plain.bias.grad = fused.weight.grad = fused.bias.grad = None
    # measured: at most 1.4e-7 of the largest element (fp32's epsilon is 1.2e-7)
    scale = float(unfused_main_grad.abs().max())
    torch.testing.assert_close(fused.weight.main_grad, unfused_main_grad, rtol=0, atol=1e-6 * scale)


def test_the_bias_gradient_goes_into_its_main_grad_bit_for_bit_in_fp32():
    """With DDP's `main_grad` on the bias too, its gradient is summed into it (fp32: the same values as autograd's sum
    then DDP's add, bit for bit) and flagged so that DDP's hook skips its own add."""
    plain, fused = _linears(seed=4)
    fused.bias.main_grad = torch.zeros_like(fused.bias)
    fused.bias.grad_added_to_main_grad = False
    unfused = torch.zeros_like(plain.bias)
    for _ in range(3):
        x = torch.randn(256, 64)
        grad = torch.randn(256, 96)
        plain(x).backward(grad)
        fused(x).backward(grad)
        unfused += plain.bias.grad
        assert fused.bias.grad_added_to_main_grad
        assert torch.equal(fused.bias.main_grad, unfused)
        plain.weight.grad = plain.bias.grad = fused.weight.grad = fused.bias.grad = None


def test_recomputed_linear_still_finds_main_grad():
    """Under non-reentrant activation checkpointing (vision_recompute) the saved weight comes back as a detached alias
    without `main_grad`: the gradient must still go into the parameter's main_grad, not into `.grad`."""
    from torch.utils.checkpoint import checkpoint

    plain, fused = _linears(seed=3)
    x = torch.randn(64, 64, requires_grad=True)
    checkpoint(fused, x, use_reentrant=False).square().sum().backward()
    plain(x).square().sum().backward()
    assert fused.weight.grad_added_to_main_grad
    assert torch.equal(fused.weight.main_grad, plain.weight.grad)


def test_without_main_grad_it_is_nn_linear():
    plain, fused = _linears(seed=1)
    del fused.weight.main_grad, fused.weight.grad_added_to_main_grad
    x = torch.randn(40, 64)
    plain(x).square().sum().backward()
    fused(x).square().sum().backward()
    assert torch.equal(fused.weight.grad, plain.weight.grad)


def test_bf16_on_cpu_without_a_kernel_keeps_the_unfused_numerics_and_with_one_runs_the_cuda_op():
    torch.manual_seed(2)
    grad, x = torch.randn(300, 48, dtype=torch.bfloat16), torch.randn(300, 32, dtype=torch.bfloat16)
    start = torch.randn(48, 32)
    unfused = start + grad.t().mm(x)  # the bf16 GEMM's .grad, then the hook's fp32 add
    main_grad = start.clone()
    accumulate_wgrad(main_grad, grad, x)
    assert torch.equal(main_grad, unfused)
    exact = start.double() + grad.double().t() @ x.double()
    fused = start.clone()
    with torch_wgrad_accum.cpu_mixed_precision_addmm(), _AtenOps() as ops:
        accumulate_wgrad(fused, grad, x)
    # one GEMM into main_grad and the transposed view of its operand, nothing else (what the step census counts)
    assert ops.names == ["aten.t.default", "aten.addmm.dtype_out"]
    # fp32 accumulation of the bf16 products: much closer to the exact sum than the bf16-rounded product
    assert (fused.double() - exact).abs().max() < (unfused.double() - exact).abs().max() / 10
    assert not torch_wgrad_accum.mixed_precision_addmm_usable(torch.device("cpu"))  # the kernel is gone again


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_megatron_kernels_stand_in_for_apex():
    from megatron.core.tensor_parallel import layers

    was_applied = patches.is_applied(
        torch_wgrad_accum.GROUP
    )  # a session fixture's model build applies it for the process
    patches.undo(torch_wgrad_accum.GROUP)
    with patches.applied(torch_wgrad_accum.GROUP):
        assert layers._grad_accum_fusion_available
        main_grad, grad, x = torch.zeros(8, 4), torch.randn(16, 8), torch.randn(16, 4)
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad, main_grad)  # Apex's argument order
        assert torch.equal(main_grad, grad.t().mm(x))
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda") and not layers._grad_accum_fusion_available
    if was_applied:
        patches.apply(torch_wgrad_accum.GROUP)


def train_with_and_without_fusion(hf_path: str) -> dict:
    """A tiny Qwen2.5-VL built by its recipe (fp32), through Megatron-Core's DDP: STEPS SGD steps of MICRO_BATCHES
    micro-batches with gradient_accumulation_fusion on, then off, from the same weights."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import unwrap_model

    from qvl.foundation import distributed
    from qvl.recipes.registry import get_recipe
    from tests.training.test_vision_grads import _batch, _forward_kwargs

    parallel_state.destroy_model_parallel()
    distributed.init_distributed(tensor_parallel=1)
    initial, out = None, {}
    for fused in (True, False):
        cfg = get_recipe("qwen2_5_vl_3b_sft").fn(hf_path=hf_path, precision="fp32", tensor_parallel=1)
        fusion_by_recipe = cfg.model.gradient_accumulation_fusion
        cfg.model.gradient_accumulation_fusion = fused
        cfg.model.finalize()
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        (model,) = cfg.model.provide_distributed_model(ddp_config=ddp, use_cpu_initialization=True)
        vlm = unwrap_model(model)
        if initial is None:
            initial = {k: v.clone() for k, v in vlm.state_dict().items() if isinstance(v, torch.Tensor)}
        vlm.load_state_dict(initial, strict=False)
        losses, marked = [], set()
        for step in range(STEPS):
            model.zero_grad_buffer()
            for micro_batch in range(MICRO_BATCHES):
                batch = _batch(vlm.config, [[1, 8, 8], [1, 4, 8]], seed=10 * step + micro_batch)
                loss = (model(**_forward_kwargs(batch)) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                loss.backward()
                losses.append(float(loss))
            marked |= {n for n, p in vlm.named_parameters() if p.grad_added_to_main_grad}
            finalize_model_grads([model])
            if step == 0:
                grads = {n: p.main_grad.clone() for n, p in vlm.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.main_grad
        tower_linears = sum(isinstance(m, MainGradLinear) for m in vlm.visual.modules())
        out[fused] = {"losses": losses, "grads": grads, "marked": marked, "tower_linears": tower_linears,
                      "by_recipe": fusion_by_recipe}  # fmt: skip
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.distributed import run_on_ranks

    hf_dir = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    tiny_hf_config("qwen2_5_vl").save_pretrained(hf_dir)
    applied_before = {g for g in patches.GROUPS if patches.is_applied(g)}
    try:  # one rank runs in this process: the groups that building the model applies are undone after
        (result,) = run_on_ranks(train_with_and_without_fusion, str(hf_dir), world_size=1, cpu=True)
    finally:
        for group in patches.GROUPS:
            if group not in applied_before:
                patches.undo(group)
    return result


@pytest.mark.slow
def test_megatron_training_with_fusion_matches_the_unfused_path(trained):
    fused, unfused = trained[True], trained[False]
    assert fused["by_recipe"]  # the recipe turns it on (no TE here)
    # Every linear weight of the LM and of the HF tower skipped the DDP hook's add; nothing did without the fusion.
    assert unfused["marked"] == set() and unfused["tower_linears"] == 0
    assert fused["tower_linears"] > 0
    tower = {n for n in fused["marked"] if n.startswith("visual.")}
    assert {n for n in fused["marked"] if ".linear_" in n or "output_layer" in n}
    assert len({n for n in tower if n.endswith(".weight")}) == fused["tower_linears"]
    assert {n for n in tower if n.endswith(".bias")}  # the tower's bias gradients go into main_grad too
    assert not any(n.endswith("bias") for n in fused["marked"] - tower)  # Megatron-Core's linears return theirs
    # The first micro-batch runs on identical weights: the same loss bit for bit; main_grad equal to fp32 rounding.
    assert fused["losses"][0] == unfused["losses"][0]
    for name, grad in unfused["grads"].items():
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert fused["losses"] == pytest.approx(unfused["losses"], abs=1e-5)


@pytest.mark.gpu
def test_bf16_fused_accumulation_matches_the_unfused_path_on_cuda():
    """bf16 activations and gradients, an fp32 main_grad: torch's addmm.dtype_out into main_grad (one GEMM) against
    the unfused path (a bf16 weight gradient, then the fp32 add), both against float64; and MainGradLinear's."""
    assert torch_wgrad_accum.mixed_precision_addmm_usable(torch.device("cuda"))
    torch.manual_seed(0)
    tokens, width_in, width_out = 8192, 1280, 3456
    main_grad = torch.randn(width_out, width_in, device="cuda") * 1e-2
    unfused = main_grad.clone()
    exact = main_grad.double()
    for _ in range(4):  # micro-batches
        grad = torch.randn(tokens, width_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, width_in, device="cuda", dtype=torch.bfloat16)
        accumulate_wgrad(main_grad, grad, x)
        unfused += grad.t().mm(x)
        exact += grad.double().t() @ x.double()
    scale = exact.abs().max()
    torch.testing.assert_close(main_grad.double(), unfused.double(), rtol=0, atol=float(scale) * 1e-2)
    assert (main_grad.double() - exact).abs().max() <= (unfused.double() - exact).abs().max()
    plain = torch.nn.Linear(width_in, width_out, device="cuda", dtype=torch.bfloat16)
    fused = torch.nn.Linear(width_in, width_out, device="cuda", dtype=torch.bfloat16)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = MainGradLinear
    fused.weight.main_grad = torch.zeros(width_out, width_in, device="cuda")
    fused.weight.grad_added_to_main_grad = False
    x = torch.randn(tokens, width_in, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, width_out, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    plain(x).backward(grad)
    fused(x).backward(grad)
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad)  # the same reduction of the same bf16 gradient
