"""An fp64 reference of a parity run's first step: transformers' model in float64 on the same conversations.

Where fp32 gradients of the two frameworks differ by more than summation order (the Gated DeltaNet's decay-gate
parameters of Qwen3.5-VL, docs/parity.md), the question is which side is off. This computes step 1's
gradients once more with every fp32 cast of transformers' modelling code turned into an fp64 one (its RMSNorms,
gate, rotary and softmax upcast to `torch.float32` explicitly, which a plain `.double()` model would keep) and
its delta rule as the exact token-by-token recurrence, with the step's per-token loss normalisation and the
recipe's clipping (`step_gradients`), and the whole run's steps with AdamW in float64 (`trajectory`). Each fp32
side's distance to it is that side's own error.
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

IGNORE = -100


class Float64Casts(TorchFunctionMode):
    """Every explicit cast to float32 (`.float()`, `.to(torch.float32)`, `dtype=torch.float32`) made to float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def recurrent_delta_rule(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_
):
    """The gated delta rule token by token in float64 (the math of transformers' torch_recurrent_gated_delta_rule,
    without its fp32 casts); [b, s, h, d] in and out."""
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    q, k, v, b, decay = (x.transpose(1, 2).double() for x in (query, key, value, beta, g))
    q = q * k.shape[-1] ** -0.5
    state = torch.zeros(*k.shape[:2], k.shape[-1], v.shape[-1], dtype=torch.float64, device=q.device)
    outputs = []
    for t in range(k.shape[2]):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, 2).transpose(1, 2).to(query.dtype), None


def fp64_model(hf_path):
    """transformers' model of the checkpoint in float64, its delta rule (if any) the exact recurrence."""
    from transformers import AutoModelForImageTextToText

    # experts run eagerly: torch._grouped_mm has no float64 kernel
    model = AutoModelForImageTextToText.from_pretrained(
        str(hf_path), dtype=torch.float64, experts_implementation="eager"
    )
    return exact_delta_rule(model)


def recurrent_reference(model):
    """The model with every Gated DeltaNet's delta rule transformers' own token-by-token recurrence (fp32), not its
    chunked fallback: the reference side of a parity check, whose decay-gate gradients are then within fp32
    rounding of exact (the chunked rule's are ~1e-3 off; kernels' tests, `benchmarks.bench_gate_gradients`)."""
    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):
            module.chunk_gated_delta_rule = _transformers_recurrence
    return model


def _transformers_recurrence(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs
):
    """transformers' `torch_recurrent_gated_delta_rule` called as its modules call the chunked rule (which also
    takes `cu_seqlens`: the reference runs each conversation alone, so there is none)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("the parity reference runs conversations one by one; a packed (cu_seqlens) call is not one")
    return torch_recurrent_gated_delta_rule(
        query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel
    )


def exact_delta_rule(model):
    """The model with every Gated DeltaNet's delta rule the exact token-by-token recurrence (in its dtype)."""
    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):
            module.chunk_gated_delta_rule = recurrent_delta_rule
    return model


def step_gradients(model, conversations: list[dict], *, clip: float) -> dict[str, torch.Tensor]:
    """One step's gradients in float64 under checkpoint names: every learned token of the step weighs the same
    (the recipe's per-token loss), then clipped to `clip` by the global norm as both frameworks clip."""
    from transformers.core_model_loading import revert_weight_conversion

    model.zero_grad(set_to_none=True)
    learned = sum(int((c["labels"][0, 1:] != IGNORE).sum()) for c in conversations)
    with Float64Casts():
        for conversation in conversations:
            inputs = {k: _double(v) for k, v in conversation.items() if k != "labels"}
            logits = model(**inputs, use_cache=False).logits[0, :-1]
            labels = conversation["labels"][0, 1:]
            ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
            ((ce * (labels != IGNORE)).sum() / learned).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    scale = _clip_scale(model, clip)
    return {n: g * scale for n, g in revert_weight_conversion(model, grads).items()}


def _double(value):
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


def relative_errors(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, float]:
    """|g - g_exact| / |g_exact| per tensor present on both sides."""
    return {
        name: float((grads[name].double() - ref).norm() / ref.norm().clamp(min=1e-300))
        for name, ref in exact.items()
        if name in grads and grads[name].shape == ref.shape
    }


def trajectory(model, steps: list[list[dict]], settings, lrs: list[float]) -> tuple[dict, dict]:
    """The reference's steps in float64: AdamW with the recipe's betas, eps, clipping and Megatron's decay groups at
    the learning rates both frameworks used (`lrs`); (step 1's clipped gradients, the final weights), both under
    checkpoint names."""
    from transformers.core_model_loading import revert_weight_conversion

    from qvl.training.parity.decay import megatron_no_decay

    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not megatron_no_decay(n, p)], "weight_decay": settings.weight_decay},
        {"params": [p for n, p in named if megatron_no_decay(n, p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
    first = {}
    for k, (conversations, lr) in enumerate(zip(steps, lrs, strict=True)):
        grads = step_gradients(model, conversations, clip=settings.clip)
        first = grads if k == 0 else first
        scale = _clip_scale(model, settings.clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
        optimizer.step()
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return first, revert_weight_conversion(model, weights)


def _clip_scale(model, clip: float) -> float:
    norm = math.sqrt(sum(float((p.grad * p.grad).sum()) for p in model.parameters() if p.grad is not None))
    return min(1.0, clip / (norm + 1e-6)) if clip else 1.0
