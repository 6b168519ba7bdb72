"""An HF vision MLP up to its output projection as one autograd Function (patch group "speed-hf-vision", used by
qvl.kernels.speed_hf_vision's `lean_gated_mlp` and `lean_mlp`): Qwen2.5-VL's gate and up projections and
`silu(gate) * up`, Qwen2-VL's fc1 and QuickGELU, with their backward written out (autograd's ops, bit for bit) so that
the activation's gradient region also sums the projections' bias gradients where they go into `main_grad`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qvl.kernels import compiled
from qvl.kernels.torch_wgrad_accum import MainGradLinear, bias_gradient_of_sum, into_main_grad, weight_gradient


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's vision MLP activation: `silu(gate) * up` (transformers' `SiLUActivation` is `F.silu`)."""
    return F.silu(gate) * up


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Qwen2-VL's vision MLP activation, transformers' `QuickGELUActivation`: `x * sigmoid(1.702 x)`."""
    return x * torch.sigmoid(1.702 * x)


def silu_gate_gradient(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `silu_gate`'s inputs: autograd's ops on the same values (its backward bit for bit)."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def silu_gate_gradient_and_sums(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`silu_gate_gradient` and the two gradients' sums over the patches in fp32 (the gate and up projections' bias
    gradients), which one compiled region takes from the values it writes instead of reading them back."""
    gate_grad, up_grad = silu_gate_gradient(gate, up, grad)
    gate_sum = gate_grad.reshape(-1, gate_grad.shape[-1]).sum(0, dtype=torch.float32)
    up_sum = up_grad.reshape(-1, up_grad.shape[-1]).sum(0, dtype=torch.float32)
    return gate_grad, up_grad, gate_sum, up_sum


def quick_gelu_gradient(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor]:
    """The gradient of `quick_gelu`'s input: autograd's ops on the same values (its backward bit for bit)."""
    sigmoid = torch.sigmoid(1.702 * x)
    return (grad * sigmoid + torch.ops.aten.sigmoid_backward(grad * x, sigmoid) * 1.702,)


def quick_gelu_gradient_and_sum(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quick_gelu_gradient` and its sum over the patches in fp32 (fc1's bias gradient), as one region."""
    (x_grad,) = quick_gelu_gradient(x, grad)
    return x_grad, x_grad.reshape(-1, x_grad.shape[-1]).sum(0, dtype=torch.float32)


@dataclass(kw_only=True, frozen=True, slots=True)
class Activation:
    """An MLP's activation over its input projections' outputs (`fn`), with its backward written out: the
    projections' output gradients (`gradient`), and those with their sums over the patches (`gradient_and_sums`)."""

    fn: Any
    gradient: Any
    gradient_and_sums: Any


SILU_GATE = Activation(fn=silu_gate, gradient=silu_gate_gradient, gradient_and_sums=silu_gate_gradient_and_sums)
QUICK_GELU = Activation(fn=quick_gelu, gradient=quick_gelu_gradient, gradient_and_sums=quick_gelu_gradient_and_sum)


def activated_projections(
    x: torch.Tensor, projections: tuple[torch.nn.Module, ...], activation: Activation
) -> torch.Tensor:
    """`activation.fn(*(p(x) for p in projections))` as `ActivatedProjections` where the projections are linears of
    one class (`nn.Linear`, or qvl.kernels.torch_wgrad_accum's `MainGradLinear`), else by calling the modules (an
    adapter around one), the activation one compiled region."""
    kind = type(projections[0])
    if kind not in (torch.nn.Linear, MainGradLinear) or any(type(p) is not kind for p in projections):
        outputs = [projection(x) for projection in projections]
        return compiled.region(activation.fn, outputs[0])(*outputs)
    params = [tensor for projection in projections for tensor in (projection.weight, projection.bias)]
    return ActivatedProjections.apply(x, activation, into_main_grad(projections[0]), *params)


class ActivatedProjections(torch.autograd.Function):
    """An HF vision MLP up to its output projection: its input projections (Qwen2.5-VL's gate and up, Qwen2-VL's
    fc1) and its activation, keeping the projections' outputs for backward (as the compiled activation region did).
    Backward:
    - the activation's gradient one compiled region on CUDA (`activation.gradient`); with the weights' gradients
      going into `main_grad` (`into_main_grad`, DDP's fusion on), that region also sums the projections' output
      gradients into their bias gradients as it writes them (`activation.gradient_and_sums`), where a bias-gradient
      region per projection read them back (66 MB per projection, block and pack at Qwen2.5-VL's width and 9,680
      patches);
    - `x`'s gradient one GEMM per projection, each after the first adding its product into the first's result
      (`addmm_`, beta = 1: the add is the GEMM's epilogue, in bf16 one rounding instead of two) instead of autograd's
      eager add;
    - the weight gradients as `MainGradLinear`'s or, without `into_main_grad`, as autograd's.
    Eagerly (CPU) everything but a two-projection `x` gradient is transformers' bit for bit (the bias gradients: the
    same sums as `bias_gradient_into`'s)."""

    @staticmethod
    def forward(ctx, x, activation: Activation, into_main_grad: bool, *params):
        weights, biases = params[0::2], params[1::2]
        outputs = [F.linear(x, weight, bias) for weight, bias in zip(weights, biases)]
        ctx.save_for_backward(x, *outputs, *weights)
        # The parameters themselves, for their main_grad (recomputed forwards save detached aliases without it).
        ctx.weights, ctx.biases, ctx.activation, ctx.into_main_grad = weights, biases, activation, into_main_grad
        return compiled.region(activation.fn, outputs[0])(*outputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        count = len(ctx.weights)
        x, *saved = ctx.saved_tensors
        outputs, weights = saved[:count], saved[count:]
        if ctx.into_main_grad:  # `count` gradients, then their `count` sums
            results = compiled.region(ctx.activation.gradient_and_sums, x)(*outputs, grad)
            output_grads, sums = results[:count], results[count:]
        else:
            output_grads, sums = compiled.region(ctx.activation.gradient, x)(*outputs, grad), (None,) * count
        x_grad = None
        if ctx.needs_input_grad[0]:
            x_grad = output_grads[0].matmul(weights[0])
            for output_grad, weight in zip(output_grads[1:], weights[1:]):
                x_grad.view(-1, x_grad.shape[-1]).addmm_(output_grad.reshape(-1, output_grad.shape[-1]), weight)
        x_2d = x.reshape(-1, x.shape[-1])
        params = []
        for i, (weight, bias, output_grad, column_sum) in enumerate(zip(ctx.weights, ctx.biases, output_grads, sums)):
            grad_2d = output_grad.reshape(-1, output_grad.shape[-1])
            weight_grad = bias_grad = None
            if ctx.needs_input_grad[3 + 2 * i]:
                weight_grad = weight_gradient(weight, grad_2d, x_2d) if ctx.into_main_grad else grad_2d.t().mm(x_2d)
            if bias is not None and ctx.needs_input_grad[4 + 2 * i]:
                bias_grad = bias_gradient_of_sum(bias, column_sum) if ctx.into_main_grad else grad_2d.sum(0)
            params += [weight_grad, bias_grad]
        return x_grad, None, None, *params
