"""`compile=True`: each block of the lean HF vision tower compiled as one graph (qvl.kernels.speed_hf_vision), on CPU with
Inductor in fp32 against the eager tower (the varlen attention an opaque op, as torch's is on CUDA), and on a GPU in
bf16 against transformers' tower; Megatron-Core's SwiGLU fusion against its eager math on a GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from qvl.foundation import patches
from qvl.foundation.errors import ConfigError
from qvl.kernels import speed_hf_vision
from qvl.kernels.tower_inputs import tower_inputs_for_config
from qvl.kernels.varlen_attention import register_hf_varlen_attention
from tests.kernels.test_speed_hf_vision import GRIDS, pixels, tiny_tower


def _tower_step(tower, x, grid, inputs):
    """Forward and backward of the lean tower with its precomputed inputs: (output, {parameter name: gradient})."""
    tower.zero_grad(set_to_none=True)
    out = tower(x, grid_thw=grid, **speed_hf_vision.tower_kwargs(inputs)).pooler_output
    out.float().square().sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in tower.named_parameters()}


def _compiled_against_eager(tower, after_each_run=lambda: None, backend="inductor"):
    """(eager, compiled) runs of the lean tower with vision recompute, the blocks compiled by `compile_block` with
    `backend` (Inductor) on the CPU between them; the varlen attention is an opaque op, as torch's is on CUDA."""
    from benchmarks.compiled_regions import opaque_varlen_attention

    tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tower.train()
    x, inputs = pixels(tower), tower_inputs_for_config(GRIDS, tower.config)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with patches.applied(speed_hf_vision.GROUP), opaque_varlen_attention():
        eager = _tower_step(tower, x, GRIDS, inputs)
        after_each_run()
        for block in tower.blocks:
            speed_hf_vision.compile_block(block, backend=backend)
        compiled = _tower_step(tower, x, GRIDS, inputs)
        after_each_run()
    assert all(block._compiled_call_impl is not None for block in tower.blocks)
    return eager, compiled


@pytest.mark.slow  # Inductor compiles the block's forward and backward with gcc: 20-90 s on two shared cores
def test_the_compiled_block_is_one_graph_and_matches_the_eager_block_on_cpu(cpu_runtime_off):
    # Dynamo tracing through the CPU runtime's TorchFunctionMode breaks vision recompute's saved-tensor check
    """The whole Qwen2.5-VL block (norms, rotary, attention, SwiGLU, residuals) compiles as one graph inside vision
    recompute; outputs and gradients equal the eager tower's within fp32 reordering."""
    (eager, eager_grads), (compiled, compiled_grads) = _compiled_against_eager(
        tiny_tower("qwen2_5_vl", attention=register_hf_varlen_attention())
    )
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_with_main_grad_linears_the_block_breaks_at_each_linear_and_still_matches(cpu_runtime_off):
    """As in training with weight-gradient accumulation (qvl.kernels.torch_wgrad_accum): each linear sets
    `grad_added_to_main_grad` on its weight in backward, which Megatron-Core's DDP clears as each step starts. Traced
    with the flag clear, Dynamo breaks the block's graph at each linear; results and `main_grad`s stay the eager ones.
    The pieces go through AOTAutograd without Inductor's code generation (`aot_eager`): the breaks and the flag's
    handling are Dynamo's and AOTAutograd's, and Inductor's kernels for this block are checked by the test above
    (compiling every piece between the linears with gcc took ~2 min on two shared cores)."""
    from qvl.kernels.torch_wgrad_accum import MainGradLinear

    tower = tiny_tower("qwen2_5_vl", attention=register_hf_varlen_attention())
    weights = []
    for module in tower.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = MainGradLinear
            weights.append(module.weight)
    main_grads = []

    def fresh_buffers():
        for weight in weights:
            weight.main_grad, weight.grad_added_to_main_grad = torch.zeros_like(weight), False

    def as_ddp_leaves_them():
        main_grads.append([w.main_grad.clone() for w in weights])
        fresh_buffers()

    fresh_buffers()
    (eager, _), (compiled, _) = _compiled_against_eager(tower, as_ddp_leaves_them, backend="aot_eager")
    assert len(main_grads) == 2 and any(g.abs().sum() > 0 for g in main_grads[0])
    # the breaks: the linears' Functions set a flag outside their graph ("Non-nullified side effect ... on
    # 'grad_added_to_main_grad'" on the pinned torch, "Unsafe side effect" on torch 2.11)
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("HOP" in reason and "side effect" in reason for reason in breaks), dict(breaks)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for compiled_grad, eager_grad in zip(*main_grads):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)


def test_without_cuda_the_blocks_stay_eager(caplog):
    tower = tiny_tower("qwen2_5_vl")
    with caplog.at_level(logging.WARNING, logger=speed_hf_vision.__name__):
        speed_hf_vision.compile_vision_blocks([tower])
    assert all(block._compiled_call_impl is None for block in tower.blocks)
    assert "run eagerly" in caplog.text


def test_compile_is_refused_for_a_megatron_vision_tower():
    from qvl.recipes.base import attach_qvl_behaviours

    config = SimpleNamespace(
        qvl=SimpleNamespace(vision_recompute=False, compile=True),
        dataset=SimpleNamespace(family="qwen3_vl"),
        model=SimpleNamespace(_pre_wrap_hooks=[]),
    )
    with pytest.raises(ConfigError, match="compile=True is for the replicated HF vision towers.*drop compile"):
        attach_qvl_behaviours(config)


# --- GPU: each compiled path in bf16 against the eager one (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_compiled_blocks_match_transformers_on_cuda_bf16(family):
    reference = tiny_tower(family, torch.bfloat16).cuda().train()
    tower = tiny_tower(family, torch.bfloat16, attention=register_hf_varlen_attention()).cuda().train()
    for model in (reference, tower):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    x, grid = pixels(tower, torch.bfloat16).cuda(), GRIDS.cuda()
    out = reference(x, grid_thw=grid).pooler_output
    out.float().square().sum().backward()
    with patches.applied(speed_hf_vision.GROUP):
        speed_hf_vision.compile_vision_blocks([tower])
        assert all(block._compiled_call_impl is not None for block in tower.blocks)
        compiled, grads = _tower_step(tower, x, grid, tower_inputs_for_config(GRIDS, tower.config).to("cuda"))
    torch.testing.assert_close(compiled, out.detach(), rtol=2e-2, atol=2e-2)
    expected = dict(reference.named_parameters())
    for name, grad in grads.items():
        scale = expected[name].grad.float().abs().max().clamp(min=1e-3)
        assert (grad.float() - expected[name].grad.float()).abs().max() <= 0.05 * scale, name


@pytest.mark.gpu
def test_megatron_swiglu_fusion_matches_its_eager_math_on_cuda_bf16():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    y = torch.randn(4096, 1, 2 * 1408, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate, up = torch.chunk(y, 2, -1)
    eager = torch.nn.functional.silu(gate) * up
    (expected,) = torch.autograd.grad(eager.float().square().sum(), y)
    fused = bias_swiglu_impl(y, None)
    (grad,) = torch.autograd.grad(fused.float().square().sum(), y)
    torch.testing.assert_close(fused, eager, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(grad, expected, rtol=1.6e-2, atol=2e-2)
