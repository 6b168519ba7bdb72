"""Weight gradients accumulated into the fp32 `main_grad` inside their GEMM, without Apex.

Megatron-Core's DDP gives every trained parameter a `main_grad` (a view of its fp32 gradient buffer) and, after each
micro-batch's backward, adds the parameter's `.grad` into it (`_make_backward_post_hook` in
megatron/core/distributed/distributed_data_parallel.py): per parameter and micro-batch one more kernel that reads the
bf16 gradient and reads and writes the fp32 buffer. With `gradient_accumulation_fusion` the weight-gradient GEMM
writes into `main_grad` itself (beta = 1) and sets `grad_added_to_main_grad`, and the hook skips its add
(`LinearWithGradAccumulationAndAsyncCommunication.backward` in megatron/core/tensor_parallel/layers.py). Megatron-Core
takes that GEMM from Apex's `fused_weight_gradient_mlp_cuda` and refuses the option without it; torch has it:

- same dtypes (fp32 training, or a bf16 `main_grad`): `main_grad.addmm_(grad_output.t(), input)`, on every device;
- bf16/fp16 inputs into an fp32 `main_grad`: `torch.addmm(main_grad, grad_output.t(), input, torch.float32,
  out=main_grad)`, the `addmm.dtype_out` overload. torch 2.14.1 has CUDA and XPU kernels for it (the CUDA one takes
  an fp32 `self` with bf16 matrices: "self dtype must match either out_dtype or mat1 dtype" in libtorch_cuda) and no
  CPU kernel. A bf16 CPU run (only the step census trains so) computes the unfused numerics there, a bf16 GEMM then
  the add, unless `cpu_mixed_precision_addmm()` gives the op a CPU kernel, as the census does to count the CUDA path.

The patch group `torch-wgrad-accum` (qvl.foundation.patches) puts these in Megatron-Core's place of Apex's kernels
(`wgrad_gemm_accum_fp32` / `_fp16`) and its import check, and allocates the placeholder gradient the backward hands
autograd on this process's device; `use_fused_wgrad_accumulation(provider)` applies it and turns the option on
wherever the model is built without Transformer Engine (every device has a path above). Not covered: Megatron-Core's
deferred embedding wgrad (`defer_embedding_wgrad_compute`, pipeline-parallel only) imports Apex itself. The
replicated HF vision tower (Qwen2-VL, Qwen2.5-VL: most of the model's parameter tensors) is transformers'
`nn.Linear`s, which Megatron's option does not reach: a pre-wrap hook gives each of them `MainGradLinear`'s backward,
the same accumulation and flag.

The word embedding is the largest weight and the option does not reach it either: `F.embedding`'s backward writes a
dense `[vocab, hidden]` gradient per micro-batch (622 MB in bf16 for Qwen2.5-VL-3B's 151,936 x 2,048), which DDP's
hook then adds into the fp32 `main_grad` (3.1 GB read and written); with the output layer tied to it on the same stage
(Megatron-Core then sets `zero_out_wgrad`) the output layer's backward also hands autograd a zeroed placeholder of that
size, and autograd adds the two first: ~6 GB of memory traffic per micro-batch for a few thousand rows. A second
pre-wrap hook marks each first-stage word embedding (`main_grad_embeddings`), and in the group Megatron-Core's
`VocabParallelEmbedding` calls `EmbeddingIntoMainGrad` for a marked weight with a `main_grad`: the gradient rows are
added into `main_grad` (`index_put_` with `accumulate=True`, in fp32: on CUDA a sort-based kernel, the same order every
run), the flag set, and autograd handed no gradient where the tied output layer hands it its placeholder (else an
unwritten one, as the linears do); `zero_out_wgrad` is cleared while the path is taken, since every contribution is
then in `main_grad` already. Not marked: `deterministic_mode` (the module indexes the weight instead) and Megatron's
GTP weight rematerialisation.

Numerics: in fp32 the GEMM adds its product into `main_grad` instead of into a zeroed `.grad` that the hook adds
after, so the sums are the same but may round differently (tests/kernels/test_torch_wgrad_accum.py measures it); in bf16 the
fused path is the more exact one (the product is not rounded to bf16 before it is accumulated).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qvl.foundation import patches
from qvl.foundation.megatron import have_transformer_engine
from qvl.kernels import compiled
from qvl.kernels.speed_aligned_widths import hf_vision_towers
from qvl.kernels.speed_small_grads import add_into_main_grad

logger = logging.getLogger(__name__)

GROUP = "torch-wgrad-accum"
# Devices whose torch build has a kernel for `addmm.dtype_out` (bf16/fp16 matrices into an fp32 result).
_MIXED_ADDMM_DEVICES = {"cuda", "xpu"}
_cpu_kernel: torch.library.Library | None = None  # `cpu_mixed_precision_addmm()`'s registration while it is active


def mixed_precision_addmm_usable(device: torch.device) -> bool:
    """Whether `device` has a kernel for `addmm.dtype_out` (bf16/fp16 matrices accumulated into an fp32 tensor)."""
    return device.type in _MIXED_ADDMM_DEVICES or (device.type == "cpu" and _cpu_kernel is not None)


def accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """`main_grad += grad_output^T @ input` (2-D operands) as one GEMM with beta = 1 where the device has one."""
    if input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), input)
    elif mixed_precision_addmm_usable(input.device):
        torch.addmm(main_grad, grad_output.t(), input, main_grad.dtype, out=main_grad)
    else:  # no kernel here (torch has none on CPU): the unfused path's GEMM in the input dtype, then the add
        main_grad.add_(grad_output.t().mm(input))


def wgrad_gemm_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's `wgrad_gemm_accum_fp32` / `_fp16` (fused_weight_gradient_dense.cpp): the same arguments and effect."""
    accumulate_wgrad(main_grad, grad_output, input)


# Megatron-Core calls `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(...)`: a namespace with Apex's two names.
TORCH_WGRAD_KERNELS = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum, wgrad_gemm_accum_fp16=wgrad_gemm_accum
)


def torch_kernels(original: Any) -> types.SimpleNamespace:
    """Patch factory for `layers.fused_weight_gradient_mlp_cuda` (absent without Apex)."""
    return TORCH_WGRAD_KERNELS


def available(original: bool) -> bool:
    """Patch factory for `layers._grad_accum_fusion_available`, the import check that refuses the option."""
    return True


def te_dummy_wgrad(original: Any):
    """Patch factory for `layers.get_dummy_wgrad` (TE's, absent without TE): the gradient Megatron-Core hands autograd
    for a weight whose gradient is already in main_grad, allocated as its non-TE branch does, on this process's
    device. Megatron-Core's own branch passes `device=torch.cuda.current_device()`, which the CPU runtime cannot map in
    a backward pass (the backward runs inside the runtime's TorchFunctionMode handler, with the mode popped)."""

    def get_dummy_wgrad(shape: list[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)

    return get_dummy_wgrad


def take_dummy_from_stand_in(original: bool) -> bool:
    """Patch factory for `layers.HAVE_TE`: True, so the backward takes its dummy gradient from `te_dummy_wgrad`. In
    layers.py the flag selects only that and, under CPU offloading (which needs TE and qvl never turns on), whether
    an input is marked for offloading instead of refusing."""
    return True


def apex_installed() -> bool:
    """Whether Apex's fused weight-gradient kernels are importable (then Megatron-Core uses them itself)."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def provide_kernels() -> None:
    """The torch kernels in Apex's place, unless Apex is installed (idempotent; stays applied for the process, as
    the CPU runtime does: the option is read when layers are built and the kernels in every backward after)."""
    if not apex_installed():
        patches.apply(GROUP)


def use_fused_wgrad_accumulation(provider: Any) -> None:
    """Weight gradients into `main_grad` inside the GEMM for a provider's model: the kernels provided, the option on
    where the model is built without Transformer Engine (TE has its own), and the HF vision tower's linears given
    the same backward when the model is built (if the option is still on then)."""
    provide_kernels()
    if not have_transformer_engine():
        provider.gradient_accumulation_fusion = True
    provider.register_pre_wrap_hook(main_grad_embeddings)
    if getattr(provider, "vision_config", None) is not None:
        provider.register_pre_wrap_hook(main_grad_linears)


def main_grad_linears(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook: every `nn.Linear` of the replicated HF vision towers accumulates its weight gradient into
    `main_grad` (when the model's `gradient_accumulation_fusion` is on)."""
    config = getattr(model[0], "config", None) if model else None
    if not getattr(config, "gradient_accumulation_fusion", False):
        return model
    swapped = 0
    for tower in hf_vision_towers(model):
        for module in tower.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = MainGradLinear
                swapped += 1
    logger.info("%d HF vision tower linears accumulate their weight gradients into main_grad", swapped)
    return model


class MainGradLinear(torch.nn.Linear):
    """`nn.Linear` whose backward adds its weight gradient into `weight.main_grad` in the GEMM, as Megatron-Core's
    fused linears do; without a `main_grad` (no DDP) it is `nn.Linear`. The forward is `F.linear`, unchanged."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearIntoMainGrad.apply(input, self.weight, self.bias)


class LinearIntoMainGrad(torch.autograd.Function):
    """`F.linear` forward; backward as autograd's addmm backward, but the weight gradient goes into `main_grad`."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        # The parameter itself, for its main_grad: under activation checkpointing the saved `weight` comes back as
        # a detached alias made in the recomputed forward (torch/utils/checkpoint.py), without the attribute.
        ctx.param, ctx.bias = weight, bias
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = (
            weight_gradient(ctx.param, grad_2d, input.reshape(-1, input.shape[-1])) if ctx.needs_input_grad[1] else None
        )
        grad_bias = _bias_gradient(ctx.bias, grad_2d) if ctx.bias is not None and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


def megatron_tower_linears_into_main_grad(tower: torch.nn.Module, language_config: Any) -> None:
    """Give the linears of Megatron-Bridge's Qwen3-VL vision tower (built from Megatron-Core's local modules) the
    language model's `gradient_accumulation_fusion`.

    `get_vision_model_config` (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/transformer_config.py) makes the
    tower's config from scratch and copies the recompute, TP and CUDA-graph settings of the language model's, not this
    one: each tower linear's weight gradient went through a bf16 `.grad` that DDP's hook then added into the fp32
    `main_grad` (Qwen3-VL-4B's census step: 848 adds, 33 GB). A local linear reads the setting in its forward
    (`self.gradient_accumulation_fusion`), and Megatron-Core's backward takes the fused path only for a weight with a
    `main_grad`, as for the language model's."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if not getattr(language_config, "gradient_accumulation_fusion", False):
        return
    for linear in tower.modules():
        if isinstance(linear, ColumnParallelLinear | RowParallelLinear):
            linear.gradient_accumulation_fusion = True
    tower.config.gradient_accumulation_fusion = True  # the tower's config, as its linears now run


# The attribute `main_grad_embeddings` sets on a word embedding's weight: its `EmbeddingRoute`.
EMBEDDING_ROUTE = "qvl_embedding_into_main_grad"


@dataclass(kw_only=True, frozen=True, slots=True)
class EmbeddingRoute:
    """How a marked word embedding hands its gradient over: `shared` when the output layer of the same stage uses the
    same weight (its backward then hands autograd the weight's placeholder gradient), and Megatron-Core's
    `zero_out_wgrad` as the model was built (restored where a call cannot take the path)."""

    shared: bool
    zero_out_wgrad: bool


def main_grad_embeddings(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook: mark the word embeddings of the first stage for `EmbeddingIntoMainGrad` (when the model's
    `gradient_accumulation_fusion` is on, so that a tied output layer's gradient is in `main_grad` too, and
    `deterministic_mode` is off)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    config = getattr(model[0], "config", None) if model else None
    if not getattr(config, "gradient_accumulation_fusion", False) or getattr(config, "deterministic_mode", False):
        return model
    for chunk in model:
        for module in chunk.modules():
            embedding = getattr(getattr(module, "embedding", None), "word_embeddings", None)
            if not isinstance(module, LanguageModule) or not module.pre_process or embedding is None:
                continue
            if getattr(embedding, "gtp_remat_size", 1) > 1:  # the forward embeds a rematerialised copy
                continue
            route = EmbeddingRoute(
                shared=bool(module.share_embeddings_and_output_weights and module.post_process),
                zero_out_wgrad=bool(getattr(embedding.weight, "zero_out_wgrad", False)),
            )
            setattr(embedding.weight, EMBEDDING_ROUTE, route)
    return model


class FunctionalWithEmbeddingIntoMainGrad:
    """`torch.nn.functional` as megatron/core/tensor_parallel/layers.py sees it in the group (`F`, of which that module
    calls only `F.embedding`): the embedding of a marked weight with a `main_grad` is `EmbeddingIntoMainGrad`,
    everything else torch's."""

    def __init__(self, functional: Any):
        self._functional = functional

    def __getattr__(self, name: str) -> Any:
        return getattr(self._functional, name)

    def embedding(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        route = getattr(weight, EMBEDDING_ROUTE, None)
        if route is None:
            return self._functional.embedding(input, weight, *args, **kwargs)
        routed = (
            not args
            and not kwargs
            and torch.is_grad_enabled()
            and weight.requires_grad
            and getattr(weight, "main_grad", None) is not None
            and hasattr(weight, "grad_added_to_main_grad")
        )
        if route.zero_out_wgrad:  # the DDP hook would add the placeholder gradients into main_grad
            weight.zero_out_wgrad = not routed
        if not routed:
            return self._functional.embedding(input, weight, *args, **kwargs)
        return EmbeddingIntoMainGrad.apply(input, weight, route.shared)


def embedding_into_main_grad(original: Any) -> FunctionalWithEmbeddingIntoMainGrad:
    """Patch factory for `layers.F` (torch.nn.functional): `FunctionalWithEmbeddingIntoMainGrad` around it."""
    return FunctionalWithEmbeddingIntoMainGrad(original)


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """`F.embedding` forward; backward adds the gradient rows into the weight's `main_grad` and sets its
    `grad_added_to_main_grad`; autograd gets no gradient for a `shared` weight (the tied output layer hands it the
    placeholder) and an unwritten placeholder otherwise, for the DDP hook, which then skips its add."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, shared: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.param, ctx.shared = weight, shared
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        param = ctx.param
        embedding_gradient_into(param.main_grad, ids, grad_output)
        if ctx.shared:  # the tied output layer hands autograd the placeholder: none allocated here
            param.grad_added_to_main_grad = True
            return None, None, None
        return None, added_to_main_grad(param), None


def embedding_gradient_into(main_grad: torch.Tensor, ids: torch.Tensor, grad_output: torch.Tensor) -> None:
    """`main_grad[ids] += grad_output` over repeated ids, in `main_grad`'s dtype (the rows are not summed in bf16
    first, as the dense gradient was)."""
    rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
    main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)


def bias_gradient_into(main_grad: torch.Tensor, grad_2d: torch.Tensor) -> None:
    """`main_grad += grad_2d.sum(0)`, the sum in `main_grad`'s dtype (in fp32 the same values as the unfused sum and
    add; with bf16 gradients the sum is not rounded to bf16 first)."""
    main_grad.add_(grad_2d.sum(0, dtype=main_grad.dtype))


def _bias_gradient(bias: torch.Tensor, grad_2d: torch.Tensor) -> torch.Tensor | None:
    """The bias gradient, added into its `main_grad` where DDP gave it one: the sum and the add one compiled region
    on CUDA with Triton (eagerly the sum, then autograd's `.grad`, then DDP's add: two kernels and a bf16 round)."""
    main_grad = getattr(bias, "main_grad", None)
    if main_grad is None or not hasattr(bias, "grad_added_to_main_grad"):
        return grad_2d.sum(0)
    compiled.region(bias_gradient_into, grad_2d)(main_grad, grad_2d)
    return added_to_main_grad(bias)


def bias_gradient_of_sum(bias: torch.Tensor, column_sum: torch.Tensor) -> torch.Tensor:
    """The bias gradient from its already summed `grad_2d.sum(0)` (fp32, from a region that wrote `grad_2d`), added
    into its `main_grad` where DDP gave it one (one small add, with the other small gradients at the end of the backward
    under speed-small-grads; the placeholder returned), else in the bias's dtype."""
    if getattr(bias, "main_grad", None) is None or not hasattr(bias, "grad_added_to_main_grad"):
        return column_sum.to(bias.dtype)
    add_into_main_grad(bias, column_sum)
    return added_to_main_grad(bias)


def weight_gradient(weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient `grad_2d^T @ input_2d`, added into its `main_grad` in the GEMM where DDP gave it one
    (the placeholder returned, or None without DDP's flag)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad_2d.t().mm(input_2d)
    accumulate_wgrad(main_grad, grad_2d, input_2d)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    return added_to_main_grad(weight)


def into_main_grad(linear: torch.nn.Module) -> bool:
    """Whether `linear`'s gradients go into `main_grad`: a `MainGradLinear` that DDP gave a `main_grad` (its fusion
    on); a plain `nn.Linear` with one returns its gradients to autograd."""
    return type(linear) is MainGradLinear and getattr(linear.weight, "main_grad", None) is not None


def added_to_main_grad(param: torch.Tensor) -> torch.Tensor:
    """Tell DDP's hook that `param`'s gradient is in its `main_grad` already (`grad_added_to_main_grad`), and return
    the unwritten placeholder gradient autograd hands the parameter so that the hook still runs (and skips its add),
    as Megatron-Core's fused linears do. Allocated only: no kernel."""
    param.grad_added_to_main_grad = True
    return torch.empty(param.main_grad.shape, dtype=param.dtype, device=param.device)


@contextlib.contextmanager
def cpu_mixed_precision_addmm() -> Iterator[None]:
    """A CPU kernel for `aten::addmm.dtype_out` (torch ships CUDA and XPU ones only) while the block runs, computed
    in the output dtype: a bf16 CPU run then takes the CUDA path of the fused accumulation. For the step census
    (benchmarks/bench_step.py counts what a CUDA device runs) and tests; training never registers it."""
    global _cpu_kernel
    if _cpu_kernel is not None:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("addmm.dtype_out", _addmm_dtype_out_cpu, "CPU")
    _cpu_kernel = library
    try:
        yield
    finally:
        _cpu_kernel = None
        library._destroy()


def _addmm_dtype_out_cpu(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, out):
    # bf16 products are exact in fp32, so this is CUDA's fp32-accumulated GEMM up to the order of its sums.
    result = torch.addmm(self.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype), beta=beta, alpha=alpha)
    return out.copy_(result)
