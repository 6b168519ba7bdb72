"""A lean replicated HF vision tower (Qwen2-VL, Qwen2.5-VL): fused norm and rotary, inputs precomputed, no host sync.

transformers' towers spend most of a training step's elementwise traffic in two places (the step census, benchmarks/bench_step.py: 354 of
435 GB per pack): the vision RMSNorm, a Python composition in fp32 (8 kernels forward, 18 backward, 2 per block), and
the vision rotary, fp32 rotate-half with a `cat` per tensor. The patch group `speed-hf-vision`
(qvl.foundation.patches) replaces both while it is applied, with transformers' numerics:

- `fused_rms_norm`: `weight * F.rms_norm(x, (d,), None, eps)`, torch's fused kernel (fp32 accumulation inside),
  then the weight in the input dtype as HF does. Bitwise equal to HF's on CPU (fp32 and bf16, tests); passing the
  weight into `F.rms_norm` instead is not (a quarter of bf16 elements differ by one ulp). On CUDA with Triton the
  same function is one compiled region (one rounding to bf16 instead of two: within bf16 rounding, a `gpu` test).
- `fused_rotary`: the same fp32 rotate-half math as one elementwise pass over q and one over k (the halves swapped
  by index, rotate-half's negation carried by the sine), on CUDA one `torch.compile`d region with only the patch
  dimension dynamic (one kernel each way, fp32 in registers; the step census counts it so,
  benchmarks/compiled_regions.py); elsewhere eager, bitwise HF's.

- `lean_attention`: the attention's forward without transformers' permutes to `[1, heads, tokens, dim]` and back
  and without its device max of the block lengths (qvl passes them from the host); q and k rotated by
  `RotaryQKV`, whose backward writes the gradient of the fused qkv projection's output in the same pass that
  un-rotates q's and k's (`rotary_qkv_gradient`) instead of un-rotating them and then stacking them with v's, the
  `unbind`'s backward (a full read and write of that output); bitwise transformers'.
- `lean_block`: the block's first residual add and its second norm one compiled region (`add_rms_norm`,
  Qwen2-VL's `add_layer_norm`): the sum and the normed sum written in one pass forward, and backward the norm's input
  gradient and the residual stream's gradient added in the same kernel instead of by autograd's eager `add`. Its
  second residual add goes with the next block's first norm the same way (`ResidualCarry`, between two blocks that
  are neither recomputed nor compiled: `tower_kwargs(inputs, tower)`), so that a tower's blocks have no eager add
  left but the last block's, forward or backward.
- `lean_gated_mlp` / `lean_mlp`: the MLP's activation (Qwen2.5-VL's `silu(gate) * up`, Qwen2-VL's QuickGELU) one
  compiled region each way on CUDA, eager elsewhere (bitwise transformers'). The MLP's input projections and its
  activation are one autograd Function (`ActivatedProjections`, qvl.kernels.hf_vision_mlp): backward the activation's region also sums the
  projections' bias gradients as it writes their output gradients, and Qwen2.5-VL's input gradient (gate and up) is
  summed in the second GEMM's epilogue instead of an eager `add` after both, the one result of this group that is not
  transformers' bit for bit in bf16 (one rounding instead of two; in fp32 the same sum in another order).

`compile_vision_blocks` (the recipe option `compile=True`) compiles each whole block on CUDA.

`tower_kwargs(inputs, tower)` are the keyword arguments a tower call takes for the inputs the loader computed on the
host from that call's `grid_thw` (qvl.kernels.tower_inputs; qvl's Qwen2-VL / Qwen2.5-VL forward passes them,
qvl.kernels.speed_sync_free, and so do the tower's graphs, qvl.kernels.tower_graphs): transformers pops them from the
tower's kwargs instead of computing them with `.tolist()` loops, and the attention function
(qvl.kernels.varlen_attention.hf_varlen_attention) takes the longest block as a Python int, so the tower's forward
reads nothing back from the device; with the tower, the call's `ResidualCarry` too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from qvl.foundation import patches
from qvl.foundation.families import family_of_provider
from qvl.kernels import compiled
from qvl.kernels.hf_vision_mlp import QUICK_GELU, SILU_GATE, activated_projections
from qvl.kernels.speed_aligned_widths import hf_vision_towers
from qvl.kernels.torch_wgrad_accum import bias_gradient_of_sum, into_main_grad, weight_gradient
from qvl.kernels.tower_inputs import TowerInputs

logger = logging.getLogger(__name__)

GROUP = "speed-hf-vision"
# Keyword the tower passes through its blocks to the attention function: ((cu_seqlens, longest block), ...).
MAX_SEQLENS_KWARG = "packed_max_seqlens"
# Keyword the tower passes through its blocks: the call's ResidualCarry.
CARRY_KWARG = "residual_carry"


def rms_norm(weight: torch.Tensor, hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2.5-VL RMSNorm through torch's fused kernel: normalised in fp32, cast, then weighted."""
    return weight * F.rms_norm(hidden_states, (hidden_states.shape[-1],), None, eps)


def fused_rms_norm(original):
    """Patch factory for `Qwen2_5_VLRMSNorm.forward`: one compiled region where qvl's compiled regions run (torch's
    fused kernel then the weight is two kernels forward and four backward), else `rms_norm` eagerly."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return compiled.region(rms_norm, hidden_states)(self.weight, hidden_states, self.variance_epsilon)

    return forward


@compiled.first_dim_dynamic
def rotary_fp32(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb_vision` math (fp32 rotate-half, results in the inputs' dtypes), bitwise on
    CPU, as one elementwise pass each over q and k in their own layout.

    transformers' `(x * cos) + (rotate_half(x) * sin)` with `rotate_half(x) = cat(-x2, x1)` is, element by element,
    `x * cos + swap(x) * signed_sin`: `swap` exchanges the two halves of the head dimension (an index, not a copy,
    once compiled) and `signed_sin` is the sine negated over the first half (`(-a) * b` and `a * (-b)` are the same
    IEEE product). The earlier form stacked q and k into one new tensor and concatenated the halves: Inductor's kernel
    for it, with every size symbolic, split each element's index by sizes known only at run time and ran ~10x under
    the H100's memory bandwidth (benchmarks/RESULTS.md, 2026-11-26). Here only the patch count is dynamic
    (`first_dim_dynamic`); `benchmarks/bench_rotary_gpu.py` measures both forms."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    first_half = torch.arange(sin.shape[-1], device=sin.device) < sin.shape[-1] // 2
    signed_sin = torch.where(first_half, -sin, sin)
    return _rotary_one(q, cos, signed_sin), _rotary_one(k, cos, signed_sin)


def _rotary_one(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((xf * cos) + (_swap_halves(xf) * signed_sin)).to(x.dtype)


def fused_rotary(original):
    """Patch factory for `apply_rotary_pos_emb_vision` (Qwen2-VL and Qwen2.5-VL modeling modules)."""

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        return compiled.region(rotary_fp32, q)(q, k, cos, sin)

    return apply_rotary_pos_emb_vision


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)


@compiled.first_dim_dynamic
def rotary_qkv_gradient(
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The gradient of `[tokens, 3, heads, dim]` qkv from those of the rotated q and k and of v: `rotary_fp32`'s
    backward (`y = x c + swap(x) s` gives `dx = dy c + swap(dy s)`, `swap` being its own inverse) and the `unbind`'s
    (`stack`) as one pass. Eagerly, autograd's ops in autograd's order: bitwise autograd's gradient of
    `rotary_fp32` then `stack`, the two products added in the other order (an IEEE sum is commutative)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    first_half = torch.arange(sin.shape[-1], device=sin.device) < sin.shape[-1] // 2
    signed_sin = torch.where(first_half, -sin, sin)
    unrotated = [
        (grad.float() * cos + _swap_halves(grad.float() * signed_sin)).to(grad.dtype) for grad in (grad_q, grad_k)
    ]
    return torch.stack((*unrotated, grad_v), dim=1)


@compiled.first_dim_dynamic
def rotary_qkv_gradient_and_sum(
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_qkv_gradient` and its sum over the patches in fp32 (the qkv projection's bias gradient), which one
    compiled region takes from the values it writes instead of reading them back."""
    grad = rotary_qkv_gradient(grad_q, grad_k, grad_v, cos, sin)
    return grad, grad.reshape(grad.shape[0], -1).sum(0, dtype=torch.float32)


class RotaryQKV(torch.autograd.Function):
    """`[tokens, 3, heads, dim]` qkv to the rotated q and k and v (a view), through `rotary_fp32`; backward one
    `rotary_qkv_gradient` (one compiled region on CUDA where two were: the rotary's backward, then the `stack`)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = qkv.unbind(1)
        ctx.save_for_backward(cos, sin)
        q, k = compiled.region(rotary_fp32, q)(q, k, cos, sin)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return compiled.region(rotary_qkv_gradient, grad_q)(grad_q, grad_k, grad_v, cos, sin), None, None


class ProjectedRotaryQKV(torch.autograd.Function):
    """`RotaryQKV` with the attention's qkv projection inside, for a `MainGradLinear` whose gradients go into
    `main_grad`: backward, the qkv gradient region also sums the gradient into the projection's bias gradient as it
    writes it (`rotary_qkv_gradient_and_sum`), where the linear's bias-gradient region read it back (74 MB per block
    and pack at Qwen2.5-VL's width and 9,680 patches); the input and weight gradients are the linear's (`main_grad`
    through `weight_gradient`). Eagerly every output and `main_grad` is the linear then `RotaryQKV` bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias, cos, sin, heads: int):
        q, k, v = F.linear(x, weight, bias).view(x.shape[0], 3, heads, -1).unbind(1)
        ctx.save_for_backward(x, weight, cos, sin)
        # The parameters themselves, for their main_grad (recomputed forwards save detached aliases without it).
        ctx.weight, ctx.bias = weight, bias
        q, k = compiled.region(rotary_fp32, q)(q, k, cos, sin)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        x, weight, cos, sin = ctx.saved_tensors
        grad_qkv, column_sum = compiled.region(rotary_qkv_gradient_and_sum, grad_q)(grad_q, grad_k, grad_v, cos, sin)
        grad_2d = grad_qkv.reshape(x.shape[0], -1)
        x_grad = grad_2d.matmul(weight) if ctx.needs_input_grad[0] else None
        weight_grad = weight_gradient(ctx.weight, grad_2d, x) if ctx.needs_input_grad[1] else None
        bias_grad = None
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            bias_grad = bias_gradient_of_sum(ctx.bias, column_sum)
        return x_grad, weight_grad, bias_grad, None, None, None


def projected_rotated_qkv(
    hidden_states: torch.Tensor, qkv: torch.nn.Module, heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """q and k rotated and v of `[tokens, hidden]` `hidden_states` through the attention's `qkv` projection: as
    `ProjectedRotaryQKV` where it is a `MainGradLinear` with a `main_grad` (DDP's fusion on) and the angles are not
    trained, else the projection called, then `rotated_qkv`."""
    if into_main_grad(qkv) and not (cos.requires_grad or sin.requires_grad):
        return ProjectedRotaryQKV.apply(hidden_states, qkv.weight, qkv.bias, cos, sin, heads)
    return rotated_qkv(qkv(hidden_states).view(hidden_states.shape[0], 3, heads, -1), cos, sin)


def rotated_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q and k rotated and v from `[tokens, 3, heads, dim]` qkv; through `RotaryQKV` unless the angles are trained
    (its backward gives them no gradient), as they are not in Qwen2-VL or Qwen2.5-VL, or a compiled block is being
    traced: there AOTAutograd derives the backward of the plain ops and Inductor fuses it with the `stack`, which is
    what `RotaryQKV` does by hand; and torch 2.11's Dynamo fails on the Function (an AssertionError in
    `overwrite_tensor_vt_proxy`, `compile=True`'s first forward)."""
    if cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling():
        q, k, v = qkv.unbind(1)
        return (*compiled.region(rotary_fp32, q)(q, k, cos, sin), v)
    return RotaryQKV.apply(qkv, cos, sin)


def lean_attention(original):
    """Patch factory for the HF vision attention's forward (Qwen2-VL `VisionAttention`, Qwen2.5-VL
    `Qwen2_5_VLVisionAttention`) where qvl's varlen attention serves it with the loader's block lengths.

    transformers' forward permutes q, k and v to `[1, heads, tokens, dim]` for the attention function, which
    permutes them back, and computes `(cu_seqlens[1:] - cu_seqlens[:-1]).max()` on the device in every call although
    the lengths came from the host: two kernels and about fourteen views each way per block. This one hands the
    `[tokens, heads, dim]` views of the fused qkv projection straight to `packed_attention`: the same kernels on the
    same tensors, bitwise the same outputs and gradients. Any other call (another attention function, no host lengths,
    the deprecated `rotary_pos_emb`) runs transformers' forward."""
    from qvl.kernels.varlen_attention import HF_VARLEN_ATTENTION, longest_block, packed_attention

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        known = kwargs.get(MAX_SEQLENS_KWARG)
        if not known or position_embeddings is None or self.config._attn_implementation != HF_VARLEN_ATTENTION:
            return original(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        tokens = hidden_states.shape[0]
        q, k, v = projected_rotated_qkv(hidden_states, self.qkv, self.num_heads, *position_embeddings)
        longest = longest_block(cu_seqlens, known, None)
        dropout_p = self.attention_dropout if self.training else 0.0
        out = packed_attention(q, k, v, cu_seqlens, cu_seqlens, longest, longest, self.scaling, dropout_p, False)
        return self.proj(out.reshape(tokens, -1))

    return forward


def add_rms_norm(
    weight: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next RMSNorm (`rms_norm`): the sum and the normed sum."""
    total = residual + delta
    return total, rms_norm(weight, total, eps)


def add_layer_norm(
    weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next LayerNorm (Qwen2-VL's, torch's `nn.LayerNorm`): the sum and the normed sum."""
    total = residual + delta
    return total, F.layer_norm(total, (total.shape[-1],), weight, bias, eps)


def _add_norm(
    norm: torch.nn.Module, residual: torch.Tensor, delta: torch.Tensor, rms_norm_type: type
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`residual + delta` and `norm` of it as one region, for the two norms the towers use; None for another."""
    if type(norm) is torch.nn.LayerNorm and norm.weight is not None and norm.bias is not None:
        return compiled.region(add_layer_norm, residual)(norm.weight, norm.bias, residual, delta, norm.eps)
    if type(norm) is rms_norm_type:
        return compiled.region(add_rms_norm, residual)(norm.weight, residual, delta, norm.variance_epsilon)
    return None


@dataclass(kw_only=True, slots=True, eq=False)
class ResidualCarry:
    """One tower call's hand-over of a block's last residual add to the next block's first norm (`lean_block`).

    transformers' tower loop passes each block's output to the next block, which norms it first: an eager add at the
    end of a block (and backward, autograd's eager add of the two gradients of its sum), then a norm. A lean block
    that knows the next block's first norm (`next_norms`) writes the sum and the normed sum in one region instead
    (`add_rms_norm`, `add_layer_norm`): it returns the sum, as before, and leaves the normed sum here; the next
    block takes it if its input is that very sum (`take`), else norms its input itself. Made per tower call
    (`for_tower`): nothing outlives the call."""

    next_norms: dict[torch.nn.Module, torch.nn.Module]  # a block -> the next block's first norm (none for the last)
    handed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)  # (a block's output, its normed output)

    @classmethod
    def for_tower(cls, tower: torch.nn.Module) -> ResidualCarry | None:
        """The carry of one call of `tower` (an HF vision tower), between each two consecutive blocks that are
        neither recomputed (a rerun in backward must see what its first run saw, and the carry has moved on by then)
        nor compiled (`compile=True` fuses inside each block); None where no two are."""
        blocks = list(getattr(tower, "blocks", ()))
        plain = [not getattr(b, "gradient_checkpointing", False) and b._compiled_call_impl is None for b in blocks]
        pairs = zip(blocks, blocks[1:], plain, plain[1:])
        next_norms = {block: after.norm1 for block, after, *both in pairs if all(both)}
        return cls(next_norms=next_norms) if next_norms else None

    def take(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The normed `hidden_states` the previous block left, None if it left none for this very tensor."""
        handed, self.handed = self.handed, None
        return handed[1] if handed is not None and handed[0] is hidden_states else None


def lean_block(original):
    """Patch factory for the HF vision block's forward (Qwen2-VL `Qwen2VLVisionBlock`, Qwen2.5-VL
    `Qwen2_5_VLVisionBlock`): transformers' `h = h + attn(norm1(h)); h = h + mlp(norm2(h))` with the first add and
    `norm2` one region (`add_rms_norm`, `add_layer_norm`): eagerly the same ops (bitwise transformers'); compiled, one
    kernel each way where there were an add and a norm forward and a norm and autograd's add of the two gradients
    of `h` backward. With the call's `ResidualCarry`, the second add and the next block's `norm1` likewise (this block
    takes its own `norm1`'s output from the carry). Another norm, or the deprecated `rotary_pos_emb`, runs
    transformers' forward."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        carry = kwargs.pop(CARRY_KWARG, None)
        if "rotary_pos_emb" in kwargs:
            return original(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        normed = carry.take(hidden_states) if carry is not None else None
        if normed is None:
            normed = self.norm1(hidden_states)
        attended = self.attn(normed, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        folded = _add_norm(self.norm2, hidden_states, attended, Qwen2_5_VLRMSNorm)
        if folded is None:
            hidden_states = hidden_states + attended
            return hidden_states + self.mlp(self.norm2(hidden_states))
        hidden_states, normed = folded
        delta = self.mlp(normed)
        after = carry.next_norms.get(self) if carry is not None else None
        handed = _add_norm(after, hidden_states, delta, Qwen2_5_VLRMSNorm) if after is not None else None
        if handed is None:
            return hidden_states + delta
        carry.handed = handed
        return handed[0]

    return forward


def lean_gated_mlp(original):
    """Patch factory for `Qwen2_5_VLMLP.forward`: the gate and up projections and the activation as
    `activated_projections` (the activation one compiled region each way on CUDA with Triton; eagerly two kernels
    forward, three backward, and the activation written and read back); bitwise transformers' on a CPU but for the
    input's gradient (one bf16 rounding fewer). Another activation runs transformers' forward."""
    from transformers.activations import SiLUActivation

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if type(self.act_fn) is not SiLUActivation:
            return original(self, hidden_state)
        return self.down_proj(activated_projections(hidden_state, (self.gate_proj, self.up_proj), SILU_GATE))

    return forward


def lean_mlp(original):
    """Patch factory for Qwen2-VL's `VisionMlp.forward`: fc1 and QuickGELU as `activated_projections` (QuickGELU one
    compiled region each way on CUDA with Triton; eagerly three kernels forward), bitwise transformers' on a CPU.
    Another activation runs transformers'."""
    from transformers.activations import QuickGELUActivation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.act) is not QuickGELUActivation:
            return original(self, x)
        return self.fc2(activated_projections(x, (self.fc1,), QUICK_GELU))

    return forward


def tower_kwargs(inputs: TowerInputs, tower: torch.nn.Module | None = None) -> dict[str, Any]:
    """The forward kwargs transformers' vision helpers pop (transformers/vision_utils.py), plus the block lengths, and
    with the `tower` called, its call's `ResidualCarry` (where its blocks allow one)."""
    kwargs: dict[str, Any] = {"position_ids": inputs.position_ids, "cu_seqlens": inputs.cu_seqlens}
    if inputs.window_index is not None:
        kwargs |= {"window_index": inputs.window_index, "cu_window_seqlens": inputs.cu_window_seqlens}
    kwargs[MAX_SEQLENS_KWARG] = inputs.max_seqlens()
    carry = ResidualCarry.for_tower(tower) if tower is not None else None
    if carry is not None:
        kwargs[CARRY_KWARG] = carry
    return kwargs


def use_lean_vision(provider: Any) -> bool:
    """Have a provider's replicated HF vision tower (Qwen2-VL, Qwen2.5-VL) run lean; True if it has one.

    A pre-wrap hook (Megatron-Bridge's extension point) applies the patch group when the model is built, and it stays
    applied for the rest of the process, as the CPU runtime does: the tower's recomputed blocks (vision_recompute)
    run in backward, outside any block a forward step could scope. On CPU its numerics are transformers' bit for
    bit; on CUDA within bf16 rounding (tests/kernels/test_speed_hf_vision.py)."""
    family = family_of_provider(provider)
    if family is None or family.megatron_vision_tower:
        return False
    provider.register_pre_wrap_hook(apply_lean_vision)
    return True


def apply_lean_vision(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook: the patch group `speed-hf-vision` applied (idempotent)."""
    patches.apply(GROUP)
    return model


def compile_vision_blocks(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook (`compile=True`): each block of every replicated HF vision tower compiled as one region on CUDA
    where Triton is (torchtitan compiles per block too); elsewhere the blocks run eagerly, as without it.

    A plain block compiles as one graph (with `MainGradLinear`s, the pieces between them: `compile_block`): its
    norms, rotary, residual adds and MLP activation fuse around the GEMMs, and the varlen attention stays one opaque
    op (torch's `varlen_attn` is a custom op); vision recompute wraps the compiled block, so a recomputed forward
    reruns the compiled graph. The blocks share their compiled graphs (same code, parameters as inputs); shapes are
    dynamic, since every pack has its own patch count."""
    if not compiled.cuda_compile_usable():
        logger.warning("compile=True: no CUDA device with Triton here, the vision blocks run eagerly")
        return model
    blocks = [block for tower in hf_vision_towers(model) for block in tower.blocks]
    for block in blocks:
        compile_block(block)
    logger.info("compile: %d vision blocks compiled", len(blocks))
    return model


def compile_block(block: torch.nn.Module, *, backend: str = "inductor") -> None:
    """One vision block compiled in place (`nn.Module.compile`: its call runs the compiled forward).

    Not `fullgraph`: with weight-gradient accumulation on, the block's linears are qvl.kernels.torch_wgrad_accum's
    `MainGradLinear`, whose autograd Function sets `grad_added_to_main_grad` on its weight in backward; Dynamo
    refuses that side effect under `fullgraph=True` ("HOP: Non-nullified side effect") and, without it, breaks the
    block at each linear and compiles the pieces between them (tests/kernels/test_vision_compile.py)."""
    block.compile(dynamic=True, backend=backend)
