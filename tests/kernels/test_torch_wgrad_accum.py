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
from tests.numerics import assert_equal_up_to_summation_order, relative_error

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


class _VocabSizedOps(TorchDispatchMode):
    """The ops whose result has the word embedding's shape: in-place writes into its `main_grad` (`into`), and new
    tensors (`others`: its dense gradient, their sums, a placeholder)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.into, self.others = weight, set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.shape == self.weight.shape and name != "detach":
            if out.data_ptr() == self.weight.main_grad.data_ptr():
                self.into.add(name)
            elif not any(isinstance(a, torch.Tensor) and a.data_ptr() == out.data_ptr() for a in args):
                self.others.add(name)
        return out


def train_with_and_without_fusion(hf_path: str) -> dict:
    """A tiny Qwen2.5-VL built by its recipe (fp32), through Megatron-Core's DDP: STEPS SGD steps of MICRO_BATCHES
    micro-batches with gradient_accumulation_fusion on, then off, from the same weights; with its word embedding and
    output layer separate (the tiny config's), then tied."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import unwrap_model

    from qvl.foundation import distributed
    from qvl.recipes.registry import get_recipe
    from tests.training.test_vision_grads import _batch, _forward_kwargs

    parallel_state.destroy_model_parallel()
    distributed.init_distributed(tensor_parallel=1)
    initial, out = {}, {}
    for tied, fused in ((False, True), (False, False), (True, True), (True, False)):
        cfg = get_recipe("qwen2_5_vl_3b_sft").fn(hf_path=hf_path, precision="fp32", tensor_parallel=1)
        fusion_by_recipe = cfg.model.gradient_accumulation_fusion
        cfg.model.gradient_accumulation_fusion = fused
        cfg.model.share_embeddings_and_output_weights = tied
        cfg.model.finalize()
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        (model,) = cfg.model.provide_distributed_model(ddp_config=ddp, use_cpu_initialization=True)
        vlm = unwrap_model(model)
        if tied not in initial:
            initial[tied] = {k: v.clone() for k, v in vlm.state_dict().items() if isinstance(v, torch.Tensor)}
        vlm.load_state_dict(initial[tied], strict=False)
        embedding = vlm.language_model.embedding.word_embeddings.weight
        losses, marked, vocab_sized = [], set(), _VocabSizedOps(embedding)
        for step in range(STEPS):
            model.zero_grad_buffer()
            for micro_batch in range(MICRO_BATCHES):
                batch = _batch(vlm.config, [[1, 8, 8], [1, 4, 8]], seed=10 * step + micro_batch)
                loss = (model(**_forward_kwargs(batch)) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                with vocab_sized:
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
        out[tied, fused] = {"losses": losses, "grads": grads, "marked": marked, "tower_linears": tower_linears,
                            "by_recipe": fusion_by_recipe, "into_main_grad": vocab_sized.into, "vocab_sized": vocab_sized.others,
                            "shared": vlm.language_model.output_layer.weight is None}  # fmt: skip
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
@pytest.mark.parametrize("tied", [False, True], ids=["separate-output-layer", "tied-output-layer"])
def test_megatron_training_with_fusion_matches_the_unfused_path(trained, tied):
    fused, unfused = trained[tied, True], trained[tied, False]
    assert fused["shared"] == unfused["shared"] == tied
    # The word embedding's gradient rows went into main_grad (tied, the output layer's GEMM too); no dense gradient,
    # sum or zeroed placeholder of its size was written (only unwritten placeholders for the DDP hook: tied, the output
    # layer's alone, as it no longer zeroes it).
    # Without the fusion: the dense gradient, the output layer's (`mm`, of the same shape) and, tied, autograd's sum of
    # the two, then DDP's add into main_grad.
    assert fused["into_main_grad"] == ({"index_put_", "addmm_"} if tied else {"index_put_"})
    assert fused["vocab_sized"] == {"empty"}
    assert unfused["into_main_grad"] == {"add_"}
    assert unfused["vocab_sized"] == {"embedding_dense_backward", "mm"} | ({"add"} if tied else set())
    assert "language_model.embedding.word_embeddings.weight" in fused["marked"]
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
        assert_equal_up_to_summation_order(fused["grads"][name], grad, what=name)
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


def _embedding_gradients(device: str, dtype: torch.dtype, micro_batches: int = 4, vocab: int = 4096):
    """The word embedding's gradient over `micro_batches` packs of repeated ids: into an fp32 main_grad by
    `embedding_gradient_into`, by the dense path (F.embedding's backward, then the fp32 add) and in float64."""
    torch.manual_seed(3)
    weight = torch.randn(vocab, 256, device=device, dtype=dtype, requires_grad=True)
    main_grad = torch.zeros(vocab, 256, device=device)
    dense, exact = main_grad.clone(), main_grad.double()
    for _ in range(micro_batches):
        ids = torch.randint(0, vocab // 8, (2048,), device=device)  # every id used ~16 times
        grad = torch.randn(2048, 256, device=device, dtype=dtype)
        torch_wgrad_accum.embedding_gradient_into(main_grad, ids, grad)
        (weight_grad,) = torch.autograd.grad(torch.nn.functional.embedding(ids, weight), weight, grad)
        dense += weight_grad.float()
        exact.index_add_(0, ids, grad.double())
    return main_grad, dense, exact


def test_embedding_gradient_rows_go_into_main_grad_as_the_dense_gradient_would():
    """fp32: the dense path's sums to fp32 rounding; bf16 gradients: the rows summed in fp32 (the dense gradient is
    rounded to bf16 per micro-batch first), so at least as close to float64."""
    main_grad, dense, exact = _embedding_gradients("cpu", torch.float32)
    torch.testing.assert_close(main_grad, dense, rtol=1e-5, atol=1e-5)
    main_grad, dense, exact = _embedding_gradients("cpu", torch.bfloat16)
    assert relative_error(main_grad, exact) < relative_error(dense, exact) / 10


@pytest.mark.gpu
def test_embedding_gradient_into_main_grad_on_cuda_is_exact_to_fp32_and_the_same_every_run():
    """On CUDA `index_put_` with `accumulate=True` sorts the ids and sums each row's gradients in one order: two runs
    give the same bits (what docs/performance.md says), and bf16 gradients land closer to float64 than the dense
    path's bf16 gradient does."""
    first, dense, exact = _embedding_gradients("cuda", torch.bfloat16)
    second, _, _ = _embedding_gradients("cuda", torch.bfloat16)
    assert torch.equal(first, second)
    assert relative_error(first, exact) < relative_error(dense, exact)
