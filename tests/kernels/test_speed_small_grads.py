"""Patch group "speed-small-grads" (qvl.kernels.speed_small_grads): the 1-D parameters' gradients go into `main_grad`
when the backward ends, by foreach kernels, giving the `main_grad` Megatron-Core's per-parameter hooks give, bit for
bit; every other hook is upstream's."""

from __future__ import annotations

import collections
import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation import megatron


@pytest.fixture(scope="module")
def upstream_factory():
    megatron.import_megatron_bridge()
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    return DistributedDataParallel._make_backward_post_hook


class _Writes(TorchDispatchMode):
    """The ops that write into one of `targets` (the main_grads), by name."""

    def __init__(self, targets: list[torch.Tensor]):
        super().__init__()
        self.pointers, self.names = {t.data_ptr() for t in targets}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        written = (
            first
            if isinstance(first, torch.Tensor)
            else (first[0] if isinstance(first, list | tuple) and first else None)
        )
        if func.overloadpacket.__name__.endswith("_") and isinstance(written, torch.Tensor):
            if written.data_ptr() in self.pointers:
                self.names.append(func.overloadpacket.__name__)
        return out


class _Model(torch.nn.Module):
    """A linear (its weight 2-D, its bias 1-D) and a norm (two 1-D parameters) in `dtype`."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(24, 40).to(dtype)
        self.norm = torch.nn.LayerNorm(40).to(dtype)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x):
        return self.norm(self.linear(x))


def _ddp_like(model: torch.nn.Module, factory, **ddp_config) -> types.SimpleNamespace:
    """What the hook reads of a DistributedDataParallel, with fp32 main_grads and the hooks registered as upstream's
    __init__ does (on each parameter's gradient accumulator)."""
    config = {"overlap_grad_reduce": False, "delay_wgrad_compute": False} | ddp_config
    ddp = types.SimpleNamespace(ddp_config=types.SimpleNamespace(**config), grad_accs=[],
                                param_to_bucket_group={p: 0 for p in model.parameters()})  # fmt: skip
    for param in model.parameters():
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        param.grad_added_to_main_grad = False
        accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
        accumulator.register_hook(factory(ddp, param))
        ddp.grad_accs.append(accumulator)
    return ddp


def _train(dtype: torch.dtype, factory, micro_batches: int = 3, device: str = "cpu") -> tuple[_Model, list[str]]:
    model = _Model(dtype).to(device)
    _ddp_like(model, factory)
    writes = _Writes([p.main_grad for p in model.parameters()])
    generator = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        x = torch.randn(16, 24, generator=generator).to(device, dtype)
        with writes:
            (model(x).float() ** 2).sum().backward()
        assert all(p.grad is None for p in model.parameters())  # every gradient went into main_grad, then released
    return model, writes.names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_1d_gradients_go_into_main_grad_when_the_backward_ends_bit_for_bit(upstream_factory, dtype):
    from qvl.kernels.speed_small_grads import batched_hook

    theirs, their_writes = _train(dtype, upstream_factory)
    ours, our_writes = _train(dtype, batched_hook(upstream_factory))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.main_grad, b.main_grad), name
        assert a.main_grad.abs().sum() > 0, name
    # Upstream: one add per parameter and micro-batch. Here: the weight's add as upstream's, the three 1-D
    # parameters' in one foreach add per backward (bf16 gradients widened first, into a scratch buffer).
    assert their_writes == ["add_"] * 4 * 3
    assert sorted(our_writes) == sorted(["add_", "_foreach_add_"] * 3)


@pytest.mark.gpu
def test_on_cuda_the_foreach_kernels_give_the_hooks_main_grad_bit_for_bit(upstream_factory):
    """The same on the device: the widening copy's and the add's CUDA kernels (their fast paths), the callback on the
    caller's stream after autograd's leaf streams."""
    from qvl.kernels.speed_small_grads import batched_hook

    theirs, _ = _train(torch.bfloat16, upstream_factory, device="cuda")
    ours, writes = _train(torch.bfloat16, batched_hook(upstream_factory), device="cuda")
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.main_grad, b.main_grad) and a.main_grad.abs().sum() > 0, name
    assert sorted(writes) == sorted(["add_", "_foreach_add_"] * 3)


def test_a_hook_outside_a_backward_adds_at_once(upstream_factory):
    from qvl.kernels.speed_small_grads import batched_hook

    model = _Model(torch.float32)
    hooks = {}
    ddp = _ddp_like(model, lambda ddp, p: hooks.setdefault(p, batched_hook(upstream_factory)(ddp, p)))
    bias = model.linear.bias
    bias.grad = torch.full_like(bias, 2.0)
    hooks[bias]()  # as Megatron-Core's delayed and GTP paths call a hook: no backward running
    assert torch.equal(bias.main_grad, torch.full_like(bias, 2.0)) and bias.grad is None
    assert not hasattr(ddp, "_qvl_small_gradients") or not ddp._qvl_small_gradients.kept  # nothing kept


def test_a_gradient_already_in_main_grad_is_not_added_again(upstream_factory):
    from qvl.kernels.speed_small_grads import batched_hook

    model = _Model(torch.float32)
    _ddp_like(model, batched_hook(upstream_factory))
    model.norm.weight.grad_added_to_main_grad = True  # as qvl's bias-gradient regions mark theirs
    (model(torch.randn(4, 24)) ** 2).sum().backward()
    assert torch.equal(model.norm.weight.main_grad, torch.zeros(40)) and model.norm.weight.grad is None
    assert model.norm.bias.main_grad.abs().sum() > 0


@pytest.mark.parametrize("setting", ["overlap_grad_reduce", "delay_wgrad_compute"])
def test_upstreams_hook_where_the_backward_must_see_each_gradient(upstream_factory, setting):
    from qvl.kernels.speed_small_grads import batched_hook

    made = set()

    def upstream(ddp, param):
        hook = upstream_factory(ddp, param)
        made.add(hook)
        return hook

    def registered(factory, **settings) -> list:
        hooks = []
        _ddp_like(_Model(torch.float32), lambda ddp, p: hooks.append(factory(ddp, p)) or hooks[-1], **settings)
        return hooks

    hooks = registered(batched_hook(upstream), **{setting: True})
    assert len(hooks) == 4 and all(hook in made for hook in hooks)  # every parameter's hook is upstream's
    hooks = registered(batched_hook(upstream))
    assert [hook in made for hook in hooks] == [True, False, False, False]  # the weight alone (2-D) without it


def test_a_backward_that_raised_leaves_nothing_for_the_next(upstream_factory):
    from qvl.kernels.speed_small_grads import batched_hook

    class Fails(torch.autograd.Function):
        """Identity forward; its backward, reached after every parameter's gradient, raises."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("a failing backward")

    model = _Model(torch.float32)
    ddp = _ddp_like(model, batched_hook(upstream_factory))
    with pytest.raises(RuntimeError, match="a failing backward"):
        (model(Fails.apply(torch.randn(4, 24, requires_grad=True))) ** 2).sum().backward()
    kept = ddp._qvl_small_gradients.kept
    assert len(kept) == 1 and len(*kept.values()) == 3  # the 1-D gradients were kept and never added
    (failed,) = kept
    assert all(p.grad is None for p in model.parameters())  # released, as upstream's hooks release them
    x = torch.randn(4, 24)
    (model(x) ** 2).sum().backward()
    reference = _Model(torch.float32)
    _ddp_like(reference, upstream_factory)
    (reference(x) ** 2).sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        if ours.dim() == 1:  # the failed backward's gradients are not in main_grad: only this one's
            assert torch.equal(ours.main_grad, theirs.main_grad), name
        assert ours.grad is None
    assert list(kept) == [failed]  # this backward's were added and let go


def test_a_recomputed_regions_reentrant_backward_adds_its_own_and_the_outer_one_its_own(upstream_factory):
    """The linear inside a reentrant checkpoint (Megatron-Core's CheckpointFunction is one): its backward runs as a
    backward of its own inside the outer one, after the norm's gradients were kept by the outer one."""
    from qvl.kernels.speed_small_grads import batched_hook

    def train(factory):
        model = _Model(torch.float32)
        ddp = _ddp_like(model, factory)
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(3), requires_grad=True)
        for _ in range(2):
            hidden = torch.utils.checkpoint.checkpoint(model.linear, x, use_reentrant=True)
            (model.norm(hidden) ** 2).sum().backward()
        return model, ddp

    ours, ddp = train(batched_hook(upstream_factory))
    theirs, _ = train(upstream_factory)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.main_grad, b.main_grad) and a.main_grad.abs().sum() > 0, name
    assert ddp._qvl_small_gradients.kept == {}


def test_a_bias_gradient_a_region_adds_itself_joins_the_batch(upstream_factory):
    """qvl's bias-gradient regions add their fp32 sum into main_grad themselves (`bias_gradient_of_sum`): with this
    group's hooks the sum waits for the end of the backward with the rest; without them, or outside a backward, it
    is added at once."""
    from qvl.kernels.speed_small_grads import batched_hook
    from qvl.kernels.torch_wgrad_accum import bias_gradient_of_sum

    def train(factory):
        model = _Model(torch.float32)
        ddp = _ddp_like(model, factory)
        bias, seen = model.norm.bias, []

        class AddsItsOwn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                bias_gradient_of_sum(bias, torch.full((40,), 0.5))
                seen.append(bias.main_grad.clone())
                return grad

        (AddsItsOwn.apply(model(torch.randn(4, 24, generator=torch.Generator().manual_seed(5)))) ** 2).sum().backward()
        return model, ddp, seen[0]

    ours, ddp, ours_during = train(batched_hook(upstream_factory))
    theirs, _, theirs_during = train(upstream_factory)
    assert torch.equal(ours_during, torch.zeros(40))  # kept until the backward's end
    assert torch.equal(theirs_during, torch.full((40,), 0.5))  # added at once
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.main_grad, b.main_grad), name
    assert ddp._qvl_small_gradients.kept == {} and ours.norm.bias.grad_added_to_main_grad
    bias_gradient_of_sum(ours.norm.bias, torch.ones(40))  # no backward running: at once
    assert torch.equal(ours.norm.bias.main_grad, theirs.norm.bias.main_grad + 1)


def train_with_and_without_the_group(hf_path: str) -> dict:
    """A tiny Qwen2.5-VL built by its recipe (fp32) in Megatron-Core's DDP, the same two micro-batches' backward with
    this group's hooks and with upstream's: the main_grads, and the ops that wrote into a 1-D main_grad."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.utils import unwrap_model

    from qvl.foundation import distributed, patches
    from qvl.kernels import speed_small_grads, torch_wgrad_accum
    from qvl.recipes.registry import get_recipe
    from tests.training.test_vision_grads import _batch, _forward_kwargs

    parallel_state.destroy_model_parallel()
    distributed.init_distributed(tensor_parallel=1)
    out, initial = {}, None
    # The tower's proj and down biases: sum and add one region (one kernel on CUDA), not a hook's add.
    region_adds, add_in_region = [], torch_wgrad_accum.bias_gradient_into
    torch_wgrad_accum.bias_gradient_into = lambda *args: (region_adds.append(1), add_in_region(*args))[1]
    for batched in (True, False):
        with patches.applied(speed_small_grads.GROUP) if batched else contextlib.nullcontext():
            cfg = get_recipe("qwen2_5_vl_3b_sft").fn(hf_path=hf_path, precision="fp32", tensor_parallel=1)
            cfg.model.finalize()
            ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
            (model,) = cfg.model.provide_distributed_model(ddp_config=ddp, use_cpu_initialization=True)
            vlm = unwrap_model(model)
            initial = initial or {k: v.clone() for k, v in vlm.state_dict().items() if isinstance(v, torch.Tensor)}
            vlm.load_state_dict(initial, strict=False)
            writes = _Writes([p.main_grad for p in vlm.parameters() if p.dim() == 1])
            model.zero_grad_buffer()
            for micro_batch in range(2):
                batch = _batch(vlm.config, [[1, 8, 8], [1, 4, 8]], seed=micro_batch)
                loss = (model(**_forward_kwargs(batch)) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                with writes:
                    loss.backward()
            out[batched] = {"grads": {n: p.main_grad.clone() for n, p in vlm.named_parameters()},
                            "writes": collections.Counter(writes.names), "region_adds": len(region_adds),
                            "kept": getattr(model, "_qvl_small_gradients", None)}  # fmt: skip
            region_adds.clear()
    torch_wgrad_accum.bias_gradient_into = add_in_region
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_megatron_ddp_of_a_tiny_qwen2_5_vl_gives_the_same_main_grads(tmp_path):
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation import patches
    from qvl.foundation.distributed import run_on_ranks

    tiny_hf_config("qwen2_5_vl").save_pretrained(tmp_path)
    applied_before = {g for g in patches.GROUPS if patches.is_applied(g)}
    try:  # one rank in this process: the groups that building the model applies are undone after
        (result,) = run_on_ranks(train_with_and_without_the_group, str(tmp_path), world_size=1, cpu=True)
    finally:
        for group in patches.GROUPS:
            if group not in applied_before:
                patches.undo(group)
    ours, theirs = result[True], result[False]
    for name, grad in theirs["grads"].items():
        assert torch.equal(ours["grads"][name], grad), name
    # Upstream: an add per 1-D parameter and micro-batch, by its hook or (the HF tower's qkv, gate and up biases) by
    # qvl's region that summed it. Here: one foreach add per backward, and the adds inside the proj and down biases'
    # sum-and-add regions (one kernel each on CUDA; eager on the CPU, as here).
    assert ours["region_adds"] == theirs["region_adds"] > 0
    assert ours["writes"] == {"_foreach_add_": 2, "add_": ours["region_adds"]}
    assert theirs["writes"]["add_"] > theirs["region_adds"] + 20 and "_foreach_add_" not in theirs["writes"]
    assert ours["kept"] is not None and ours["kept"].kept == {} and theirs["kept"] is None
