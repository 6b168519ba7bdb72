"""An MoE layer's local experts as two grouped GEMMs, without Transformer Engine (patch group
"speed-grouped-experts" of qvl.foundation.patches; recipe option `grouped_experts=true`, off until its GPU test has
passed on a GPU).

Without TE, Megatron-Core builds an MoE layer's experts as `SequentialMLP` (the legacy `GroupedMLP` needs the
`grouped_gemm` package): each local expert an MLP of its own, run one after another on its share of the tokens. Per
layer and micro-batch that is a host read of the token counts (`tokens_per_expert.tolist()`) and, per local expert,
a split, two GEMMs and the activation forward and again backward: Qwen3-VL-30B-A3B at EP=8 has 16 local experts in
each of its 48 layers. torch has the grouped GEMM itself (`torch.nn.functional.grouped_mm`: CUTLASS kernels for bf16
on SM90/SM100, a loop of GEMMs elsewhere, and a CPU kernel), which takes the groups' ends as a device tensor.

Here the local experts run as `linear_fc1` of all of them (one grouped GEMM), the activation and the routing weights
on all the tokens at once (upstream's functions: the same values per token), and `linear_fc2` (one grouped GEMM).
LoRA adapters on the experts (Megatron-Bridge's `LoRALinear` around each expert linear) run as two more grouped GEMMs
per linear, with the communication qvl.kernels.fix_expert_adapter_tp gives them where the expert-TP ranks split them.
The experts' parameters stay the same modules, names and checkpoints (conversion, adapters and exports see no
change). The stacked weights are made in the forward and again in the backward rather than kept for it, so memory
grows by one layer's local expert weights at a time, not by every layer's. Weight gradients come out of one grouped
GEMM per linear, in the weights' dtype (the CUTLASS kernels write bf16; an fp32 output falls back to a loop with a
host read), and go to `main_grad` as one cast and one foreach add where Megatron-Core's DDP gave the parameters one,
flagged as its fused linears flag them: in bf16 each micro-batch's weight gradient is rounded to bf16 before it is
accumulated, as in Megatron-Core without gradient-accumulation fusion. Frozen weights (a PEFT run's experts) get no
weight-gradient GEMM.

A layer runs upstream's forward where this cannot give the same function: one local expert, adapters other than
LoRA (or LoRA with dropout or an activation), biases, FP8/FP4, TE's activation module, clamped or offset GLUs, the
activation recomputed on its own (`recompute_modules` with `moe_act`), delayed weight gradients, float64, widths
whose rows are not 16-byte aligned (grouped_mm's layout rule, a LoRA rank included), and a micro-batch that routes
no token here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from qvl.kernels.fix_expert_adapter_tp import split_product

GROUP = "speed-grouped-experts"


class GroupedLinear(torch.autograd.Function):
    """`y[rows of group e] = x[rows of group e] @ weights[e].T`, the groups' ends in `ends` (int32, on x's device).
    The stacked weights are not saved for the backward (made again there)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends)
        ctx.weights = weights  # the parameters themselves, for their main_grad (as torch_wgrad_accum keeps them)
        return F.grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, ends = ctx.saved_tensors
        weights = ctx.weights
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, torch.stack(weights), offs=ends) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_weights = weight_gradients(weights, F.grouped_mm(grad.t(), x, offs=ends))
        return grad_x, None, *grad_weights


def weight_gradients(weights: tuple[torch.Tensor, ...], stacked: torch.Tensor) -> list[torch.Tensor | None]:
    """Each weight's gradient (its row of `stacked`), added into its `main_grad` where DDP gave it one: then as one
    foreach add, flagged for DDP's hook, which skips its own add (the same contract as Megatron-Core's fused
    linears and qvl.kernels.torch_wgrad_accum)."""
    if not all(getattr(w, "main_grad", None) is not None for w in weights):
        return list(stacked.unbind(0))
    # in main_grad's dtype first (one cast of the stack): a foreach add over lists of one dtype is a few kernels
    main_grads = [w.main_grad for w in weights]
    torch._foreach_add_(main_grads, list(stacked.to(main_grads[0].dtype).unbind(0)))
    flagged = [hasattr(w, "grad_added_to_main_grad") for w in weights]
    for weight in weights:
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    # A gradient still goes to each parameter, so its DDP hook runs (and skips its add): Megatron-Core does the same.
    return [torch.empty_like(w) if flag else None for w, flag in zip(weights, flagged, strict=True)]


def reads_nothing_back(tokens: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM on `tokens` (their device and dtype) takes the groups' ends without reading them to
    the host: its CUTLASS kernels (bf16 on SM90 and SM100) and its CPU kernel do; elsewhere it loops over the groups
    at ends copied to the host (aten's `_grouped_mm_fallback`), which a CUDA graph cannot capture."""
    if tokens.device.type == "cpu":
        return True
    if tokens.device.type != "cuda" or tokens.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(tokens.device)[0] in (9, 10)


def groupable(experts: Any, tokens: torch.Tensor) -> bool:
    """Whether `experts` (a SequentialMLP) on `tokens` can run as grouped GEMMs with the same function."""
    return grouped_parts(experts, tokens) is not None


def grouped_parts(experts: Any, tokens: torch.Tensor) -> list | None:
    """Each local expert's `expert_linears` where `experts` (a SequentialMLP) on `tokens` can run as grouped GEMMs
    with the same function, else None (see the module text for each condition)."""

    config = experts.config
    if experts.num_local_experts < 2 or tokens.dim() != 2 or tokens.shape[0] == 0 or not tokens.is_contiguous():
        return None
    if tokens.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # grouped_mm has no float64 kernel
        return None
    if config.fp8 or getattr(config, "fp4", None) or config.use_te_activation_func or config.delay_wgrad_compute:
        return None
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
        return None
    if "moe_act" in (config.recompute_modules or []) and config.recompute_granularity == "selective":
        return None
    if config.bias_activation_fusion and not (config.gated_linear_unit and config.activation_func is F.silu):
        return None
    parts = [expert_linears(expert) for expert in experts.local_experts]
    if any(p is None for p in parts) or len({tuple(a is None for a in p[1]) for p in parts}) != 1:
        return None  # another linear, an adapter we cannot group, or experts adapted differently
    (fc1, fc2), (lora1, lora2) = parts[0]
    if fc1.weight.dtype != tokens.dtype:
        return None
    widths = [tokens.shape[1], *fc1.weight.shape, *fc2.weight.shape]
    for lora in (lora1, lora2):
        if lora is not None:
            widths += [*lora.linear_in.weight.shape, *lora.linear_out.weight.shape]
    aligned = tokens.data_ptr() % 16 == 0 and all(width * tokens.element_size() % 16 == 0 for width in widths)
    return parts if aligned else None


def expert_linears(expert: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
    """((linear_fc1, linear_fc2), (their LoRA adapters or None)) of a local expert: Megatron-Core's plain parallel
    linears, each bare or wrapped by Megatron-Bridge's LoRA (an enabled `ParallelLinearAdapter`, identity activation,
    no dropout); None where anything else is there."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    bases, adapters = [], []
    for name, kind in (("linear_fc1", ColumnParallelLinear), ("linear_fc2", RowParallelLinear)):
        linear, adapter = getattr(expert, name, None), None
        if type(linear).__name__ == "LoRALinear":  # Megatron-Bridge's wrapper (megatron.bridge.peft.lora_layers)
            adapter, linear = (linear.adapter if linear._adapter_enabled else None), linear.to_wrap
            if adapter is not None and not lora_groupable(adapter):
                return None
        if type(linear) is not kind or linear.bias is not None:
            return None
        bases.append(linear)
        adapters.append(adapter)
    return (bases[0], bases[1]), (adapters[0], adapters[1])


def lora_groupable(adapter: Any) -> bool:
    """Whether a LoRA adapter is the plain low-rank product the grouped path computes (Megatron-Bridge's
    `ParallelLinearAdapter` with an identity activation, no dropout, no all-to-all)."""
    return (
        type(adapter).__name__ == "ParallelLinearAdapter"
        and isinstance(adapter.activation, torch.nn.Identity)
        and isinstance(adapter.dropout, torch.nn.Identity)
        and not adapter.use_a2a
    )


def lora_output(adapters: list[Any], tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Every local expert's LoRA adapter of one linear on its tokens, as grouped GEMMs: the adapter's forward, with
    the communication qvl.kernels.fix_expert_adapter_tp gives it where the expert-TP ranks split it."""

    def grouped(factor: str) -> Callable:
        return lambda v: GroupedLinear.apply(v, ends, *(getattr(a, factor).weight for a in adapters))

    first = adapters[0]
    return split_product(first, tokens, grouped("linear_in"), grouped("linear_out")) * (first.alpha / first.dim)


def activation(experts: Any, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' activation times each token's routing weight, as Megatron-Core's `MLP.forward` computes it for
    an expert (its non-TE branches)."""
    config = experts.config
    if config.bias_activation_fusion:  # SwiGLU only (groupable)
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

        return weighted_bias_swiglu_impl(hidden, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
    if config.gated_linear_unit:
        gate, linear = torch.chunk(hidden, 2, dim=-1)
        hidden = config.activation_func(gate) * linear
    else:
        hidden = experts.local_experts[0].activation_func(hidden)
    return (hidden * probs.unsqueeze(-1)).to(hidden.dtype)


def grouped_forward(experts: Any, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                    parts: list) -> tuple[torch.Tensor, None]:  # fmt: skip
    """`SequentialMLP.forward` as two grouped GEMMs, given the experts' `grouped_parts`: (output, None)."""
    if experts.config.moe_apply_probs_on_input:  # as upstream: top-1 only, weights on the input, then ones
        tokens = (probs.unsqueeze(-1) * tokens).to(tokens.dtype)
        probs = torch.ones_like(probs)
    ends = torch.cumsum(tokens_per_expert.to(device=tokens.device, non_blocking=True), 0, dtype=torch.int32)
    outputs = tokens
    for k in (0, 1):  # linear_fc1, then the activation, then linear_fc2
        inputs = outputs if k == 0 else activation(experts, outputs, probs)
        outputs = GroupedLinear.apply(inputs, ends, *(bases[k].weight for bases, _ in parts))
        if parts[0][1][k] is not None:
            outputs = outputs + lora_output([adapters[k] for _, adapters in parts], inputs, ends)
    return outputs, None


def grouped_experts(original: Callable) -> Callable:
    """Replacement factory for `SequentialMLP.forward`: grouped GEMMs where `groupable`, else upstream's."""

    @functools.wraps(original)
    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        parts = grouped_parts(self, permuted_local_hidden_states)
        if parts is None:
            return original(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, parts)

    return forward
