"""qvl's Qwen3-VL vision tower given host-computed inputs (qvl.bridges.qwen3_vl.Qwen3VLVisionModel, its body
qvl.kernels.speed_qwen3_vl_tower): outputs and gradients bitwise upstream's, no read of a device value on the CUDA code
path, and the loader's inputs reaching the tower inside the model as its forward's argument."""

from __future__ import annotations

import traceback
from unittest import mock

import pytest
import torch

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.kernels import speed_qwen3_vl_tower
from qvl.kernels.tower_inputs import MegatronTowerInputs, tower_inputs_for_config
from tests.kernels.test_speed_hf_vision import HostReads
from tests.tiny_megatron import tiny_megatron_model

# Several images of different grids (square, wide, tall, the smallest) and a three-frame video, in one tower call.
GRIDS = torch.tensor([[1, 8, 12], [1, 4, 4], [3, 4, 8], [1, 10, 6], [1, 2, 2]])


@pytest.fixture(scope="module")
def tower():
    """The tiny Qwen3-VL family record's Megatron vision tower, built by qvl's provider (local specs, fp32)."""
    from qvl.foundation import distributed, runtime

    runtime.activate(force=True)
    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model("qwen3_vl", gradient_accumulation_fusion=False)  # no DDP: no main_grad
        (vision,) = speed_qwen3_vl_tower.megatron_vision_towers(model)
        assert type(vision).__module__ == "qvl.bridges.qwen3_vl"  # qvl's tower class
        with torch.no_grad():  # norms at 1 and biases at 0 would hide a mix-up: perturb them
            for param in vision.parameters():
                param.add_(0.05 * torch.randn_like(param))
        yield vision
    finally:
        distributed.destroy_distributed()
        runtime.deactivate()


def pixels(tower, dtype=torch.float32) -> torch.Tensor:
    config = tower.config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(GRIDS.prod(-1).sum()), width, generator=torch.Generator().manual_seed(1)).to(dtype)


def run(tower, x, grid, inputs=None):
    """Forward and backward of the tower called with `grid` and (if given) its precomputed `inputs`: its output,
    deepstack features and every parameter's gradient."""
    tower.zero_grad(set_to_none=True)
    out, deepstack = tower(hidden_states=x, grid_thw=grid, tower_inputs=inputs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float32).view_as(out)
    loss = (out.float() * weights).sum() + sum((d.float() ** 2).sum() for d in deepstack)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in tower.named_parameters() if p.grad is not None}
    return out.detach(), [d.detach() for d in deepstack], grads


def prepared_calls(monkeypatch) -> list:
    """The tower inputs of each call that takes the prepared path (looked up by qvl's tower forward at each call)."""
    calls = []
    prepared = speed_qwen3_vl_tower.prepared_tower_forward
    monkeypatch.setattr(speed_qwen3_vl_tower, "prepared_tower_forward", lambda *a: calls.append(a[2]) or prepared(*a))
    return calls


def assert_bitwise(got, expected):
    (out, deepstack, grads), (out_ref, deepstack_ref, grads_ref) = got, expected
    assert torch.equal(out, out_ref)
    assert len(deepstack) == len(deepstack_ref) > 0 and all(map(torch.equal, deepstack, deepstack_ref))
    assert grads.keys() == grads_ref.keys() and "pos_embed.weight" in grads
    differing = [name for name in grads if not torch.equal(grads[name], grads_ref[name])]
    assert differing == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepared_tower_is_upstream_bit_for_bit_with_its_gradients(tower, dtype, monkeypatch):
    calls = prepared_calls(monkeypatch)
    params = [(p, p.detach().clone()) for p in tower.parameters()]
    buffers = {name: b.clone() for name, b in tower.named_buffers()}
    tower.to(dtype)  # the tower holds process groups: converted in place and restored, not copied
    try:
        x = pixels(tower, dtype)
        inputs = tower_inputs_for_config(GRIDS, tower.config)
        assert isinstance(inputs, MegatronTowerInputs)
        expected = run(tower, x, GRIDS)
        assert calls == []
        assert_bitwise(run(tower, x, GRIDS, inputs), expected)
        assert calls == [inputs]
    finally:
        for param, value in params:
            param.data = value
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(tower.get_submodule(owner), leaf, value)


def test_without_inputs_upstreams_path_runs_and_wrong_inputs_are_refused(tower):
    """A call without inputs computes its own from the device grid (upstream's forward, reading it); inputs for
    other grids are refused rather than used."""
    x = pixels(tower)
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    with HostReads() as reads:
        own = run(tower, x, GRIDS)
    assert reads.reads  # upstream read its grid
    assert_bitwise(own, run(tower, x, GRIDS, inputs))
    wrong = tower_inputs_for_config(GRIDS[1:], tower.config)
    with pytest.raises(speed_qwen3_vl_tower.TowerInputsMismatch, match="compute the tower inputs from the grid"):
        tower(x, GRIDS, tower_inputs=wrong)


def test_prepared_tower_reads_nothing_back_on_the_cuda_path(tower, monkeypatch):
    """On the code path a CUDA device takes (torch's varlen kernel), the prepared tower's forward and backward read
    no tensor value back; upstream's reads dozens."""
    from qvl.kernels import varlen_attention

    lengths = []
    monkeypatch.setattr(varlen_attention, "varlen_usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(varlen_attention, "varlen_attention", stand_in_varlen(lengths))
    x = pixels(tower)
    with HostReads() as reads:
        expected = run(tower, x, GRIDS)
    upstream_reads = len(reads.reads)
    lengths.clear()
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    with DeviceReads() as reads:
        tower.zero_grad(set_to_none=True)
        out, deepstack = tower(hidden_states=x, grid_thw=GRIDS, tower_inputs=inputs)
        (out.sum() + sum(d.sum() for d in deepstack)).backward()
    assert upstream_reads > tower.config.num_layers
    assert reads.reads == []
    assert lengths == [(int, int)] * tower.config.num_layers  # every block's longest length a Python int
    assert torch.equal(out.detach(), expected[0])


def stand_in_varlen(lengths):
    """`varlen_attention` as a CUDA device runs it, on CPU: records the longest lengths' types, then attends per
    block with SDPA (its own reads of `cu_seqlens` not counted)."""

    def varlen_attention(query, key, value, cu_q, cu_kv, max_q, max_k, *, causal, scale):
        lengths.append((type(max_q), type(max_k)))
        HostReads.paused = True
        try:
            out = torch.empty_like(query)
            bounds = cu_q.tolist()
            for start, end in zip(bounds, bounds[1:]):
                out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                    *(t[start:end].transpose(0, 1) for t in (query, key, value)), is_causal=causal, scale=scale
                ).transpose(0, 1)
            return out
        finally:
            HostReads.paused = False

    return varlen_attention


class DeviceReads(HostReads):
    """`HostReads` without the model-parallel RNG tracker's check after each fork, which compares two CPU generator
    states (megatron/core/tensor_parallel/random.py): host tensors on a CUDA device too, no sync."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(frame.filename.endswith("tensor_parallel/random.py") for frame in traceback.extract_stack(limit=6)):
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def test_megatron_tower_inputs_refuse_a_device_grid():
    with pytest.raises(ValueError, match="on the CPU"):
        tower_inputs_for_config(GRIDS.to("meta"), tiny_hf_config("qwen3_vl").vision_config)


@pytest.mark.slow
def test_loader_tower_inputs_reach_the_qwen3_vl_models_tower(tmp_path, cpu_runtime):
    """The loader computes each micro-batch's Megatron tower inputs in its workers; the training step's host batch
    hands them to the tower inside qvl's Qwen3-VL model, whose loss is bitwise upstream's forward's."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.load import build_packed_datasets
    from qvl.data.prepare import PrepareConfig, prepare
    from qvl.data.samples import write_sample_dataset
    from qvl.foundation import distributed
    from qvl.training.step import host_batch, model_inputs

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=8, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_vl")
    prepare(
        PrepareConfig(
            input=jsonl, media_root=media, family="qwen3_vl", hf_path=hf, seq_length=512, output=tmp_path / "data"
        )
    )
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # whatever an earlier test of this process left
    distributed.init_distributed()
    try:
        # no DDP wrapper here, so no main_grad to accumulate into
        model, hf_config = tiny_megatron_model("qwen3_vl", hf=hf, gradient_accumulation_fusion=False)
        config = dict(path=str(tmp_path / "data"), hf_path=str(hf), family="qwen3_vl", micro_batch_size=1)
        loader, _, _ = build_packed_datasets(type("DatasetConfig", (), {**config, "num_workers": 0}), None)
        batch = next(iter(loader))
        assert isinstance(batch.image_tower_inputs, MegatronTowerInputs)
        expected = tower_inputs_for_config(batch.image_grid_thw, hf_config.vision_config)
        assert torch.equal(batch.image_tower_inputs.pos_embed_weight, expected.pos_embed_weight)
        kwargs, _ = model_inputs(batch, torch.device("cpu"))
        (vision,) = speed_qwen3_vl_tower.megatron_vision_towers(model)
        given = []
        derived = model(**kwargs)
        derived.sum().backward()
        derived_grads = [p.grad.clone() for p in vision.parameters()]  # every one is used: none is None
        model.zero_grad()
        host = host_batch(model, batch, kwargs, torch.device("cpu"))
        vision.register_forward_pre_hook(lambda m, a, kw: given.append(kw.get("tower_inputs")), with_kwargs=True)
        prepared = model(**kwargs, host_batch=host)
        prepared.sum().backward()
        assert len(given) == 1 and given[0] is host.image_tower_inputs
        assert torch.equal(prepared, derived)
        assert all(torch.equal(p.grad, g) for p, g in zip(vision.parameters(), derived_grads))
    finally:
        distributed.destroy_distributed()


def test_the_blocks_bias_gelu_and_bias_dropout_add_run_fused_where_megatrons_jit_fusions_run(
    tower, monkeypatch, cpu_runtime
):
    """Where Megatron-Core's `jit_fuser` regions compile (CUDA with Triton), qvl's Qwen3-VL model turns on the vision
    blocks' bias-GELU (the same tanh GELU) and bias-dropout-add: the tower calls them, and gives the eager tower's
    embeddings, deepstack features and gradients to fp32 rounding; the patch mergers keep their exact GELU. Elsewhere
    (this CPU) the tower is built as Megatron-Bridge builds it. The fused functions run eagerly here (their compiled
    kernels are counted by the step census, benchmarks/compiled_regions.py)."""
    import collections

    from megatron.core import parallel_state
    from megatron.core.fusions import fused_bias_dropout, fused_bias_gelu

    from qvl.foundation import distributed, megatron

    calls = collections.Counter()
    for module, name in ((fused_bias_gelu, "bias_gelu"), (fused_bias_gelu, "bias_gelu_back"),
                         (fused_bias_dropout, "bias_dropout_add_fused_train")):  # fmt: skip
        eager = getattr(getattr(module, name), "_torchdynamo_orig_callable", getattr(module, name))
        monkeypatch.setattr(module, name, lambda *args, eager=eager, name=name: calls.update([name]) or eager(*args))
    assert not tower.config.bias_activation_fusion and not tower.config.bias_dropout_fusion  # built on this CPU
    monkeypatch.setattr(megatron, "jit_fusions_usable", lambda: True)
    parallel_state.destroy_model_parallel()  # whatever an earlier test of this process left
    distributed.init_distributed()
    try:
        _check_fused_tower(tower, calls)
    finally:
        distributed.destroy_distributed()


def _check_fused_tower(tower, calls) -> None:
    """The tiny model built where jit fusions run: its tower's fused calls, and its outputs and gradients against the
    eager `tower` with the same weights."""
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP

    model, _ = tiny_megatron_model("qwen3_vl", gradient_accumulation_fusion=False)  # no DDP: no main_grad
    (fused,) = speed_qwen3_vl_tower.megatron_vision_towers(model)
    fused.load_state_dict(tower.state_dict())
    assert fused.config.bias_activation_fusion and fused.config.bias_dropout_fusion
    mlps = [m for m in fused.decoder.modules() if isinstance(m, MLP)]
    assert mlps and all(m.activation_func is F.gelu for m in mlps)
    mergers = [m for m in fused.modules() if hasattr(m, "patch_norm")]
    assert mergers and all(m.activation_func is F.gelu for m in mergers)  # exact GELU, as transformers'
    inputs = tower_inputs_for_config(GRIDS, tiny_hf_config("qwen3_vl").vision_config)
    x = pixels(tower)
    out, deepstack, grads = run(fused, x, GRIDS, inputs)
    layers = len(mlps)
    assert calls == {"bias_gelu": layers, "bias_gelu_back": layers, "bias_dropout_add_fused_train": 2 * layers}
    ref_out, ref_deepstack, ref_grads = run(tower, x, GRIDS, inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for got, expected in zip(deepstack, ref_deepstack, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_tower_with_exact_gelu_is_left_as_built(tower, monkeypatch):
    import torch.nn.functional as F

    monkeypatch.setattr(tower.config, "activation_func", F.gelu)  # Megatron's fused GELU is the tanh approximation
    assert not speed_qwen3_vl_tower.fuse_bias_ops(tower)
    assert not tower.config.bias_activation_fusion and not tower.config.bias_dropout_fusion


def check_fused_bias_ops_against_fp64(device: str, rows: tuple[int, ...]) -> None:
    """Megatron-Core's compiled bias-GELU and bias-dropout-add (dropout 0) in bf16 on `device`, against the eager ops
    they replace in the Qwen3-VL vision tower: outputs and every gradient as close to fp64 as the eager ones. The fp64
    reference is the eager ops (the fused GELU is the same tanh formula). Each is compiled here as `jit_fuser`
    compiles it where the fusions run: on the CPU qvl keeps them eager (qvl.foundation.megatron.deferred_compile)."""
    import torch.nn.functional as F
    from megatron.core.fusions import fused_bias_gelu
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    from tests.numerics import assert_as_close_as_eager

    def compiled(fn):
        return torch.compile(getattr(fn, "_torchdynamo_orig_callable", fn))

    gelu_forward, gelu_backward = compiled(fused_bias_gelu.bias_gelu), compiled(fused_bias_gelu.bias_gelu_back)
    bias_dropout_add = compiled(bias_dropout_add_fused_train)
    generator = torch.Generator().manual_seed(0)
    width, ffn = 1024, 4096  # Qwen3-VL's vision tower
    for n in rows:
        y, bias = 2 * torch.randn(n, ffn, generator=generator), 0.5 * torch.randn(ffn, generator=generator)
        x, residual = torch.randn(n, width, generator=generator), torch.randn(n, width, generator=generator)
        small_bias = 0.5 * torch.randn(width, generator=generator)
        grad_ffn, grad_width = torch.randn(n, ffn, generator=generator), torch.randn(n, width, generator=generator)

        def gelu(dtype, fused):
            inputs = [t.to(device, dtype).requires_grad_() for t in (y, bias)]
            out = (
                fused_bias_gelu.bias_gelu_impl(*inputs) if fused else F.gelu(inputs[0] + inputs[1], approximate="tanh")
            )
            out.backward(grad_ffn.to(device, dtype))
            return [out, *(t.grad for t in inputs)]

        def bda(dtype, fused):
            inputs = [t.to(device, dtype).requires_grad_() for t in (x, small_bias, residual)]
            if fused:
                out = bias_dropout_add((inputs[0], inputs[1]), inputs[2], 0.0)
            else:
                out = inputs[2] + (inputs[0] + inputs[1])
            out.backward(grad_width.to(device, dtype))
            return [out, *(t.grad for t in inputs)]

        for name, path, parts in (("bias-GELU", gelu, ("output", "input gradient", "bias gradient")),
                                  ("bias-dropout-add", bda, ("output", "x gradient", "bias gradient",
                                                             "residual gradient"))):  # fmt: skip
            reference = path(torch.float64, False)
            with mock.patch.multiple(fused_bias_gelu, bias_gelu=gelu_forward, bias_gelu_back=gelu_backward):
                fused = path(torch.bfloat16, True)
            eager = path(torch.bfloat16, False)
            for what, got, plain, exact in zip(parts, fused, eager, reference, strict=True):
                assert_as_close_as_eager(got, plain, exact, what=f"{name} {what}, {n} rows")


@pytest.mark.slow  # Inductor compiles the fused functions for the CPU (~20 s on 2 cores)
def test_the_fused_bias_ops_are_as_close_to_fp64_as_eager_compiled_for_the_cpu():
    check_fused_bias_ops_against_fp64("cpu", rows=(64, 96))


@pytest.mark.gpu
def test_the_fused_bias_ops_are_as_close_to_fp64_as_eager_on_cuda():
    from qvl.kernels import compiled

    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    check_fused_bias_ops_against_fp64("cuda", rows=(4096, 10240))


def test_the_towers_linears_add_their_weight_gradients_into_main_grad_as_the_language_models_do(tower):
    """Megatron-Bridge makes the tower's config without the language model's `gradient_accumulation_fusion`; qvl's
    model gives its linears the setting (torch_wgrad_accum.megatron_tower_linears_into_main_grad): with DDP's
    `main_grad` each weight gradient goes there inside its GEMM and the weight's `.grad` is a placeholder, equal to
    autograd's gradient within fp32 rounding."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from qvl.foundation import distributed, runtime

    off = [m for m in tower.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert off and not any(linear.gradient_accumulation_fusion for linear in off)  # the fixture's LM has it off
    runtime.activate(force=True)  # puts back redirections an earlier test undid through the registry
    parallel_state.destroy_model_parallel()  # whatever an earlier test of this process left
    distributed.init_distributed()
    try:
        _check_tower_into_main_grad()
    finally:
        distributed.destroy_distributed()


def _check_tower_into_main_grad() -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model, _ = tiny_megatron_model("qwen3_vl")  # as training builds it: the fusion on (no TE here)
    (fused,) = speed_qwen3_vl_tower.megatron_vision_towers(model)
    assert model.config.gradient_accumulation_fusion and fused.config.gradient_accumulation_fusion
    linears = {name: m for name, m in fused.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)}
    assert linears and all(linear.gradient_accumulation_fusion for linear in linears.values())
    x = pixels(fused)
    for linear in linears.values():  # autograd's gradients first
        linear.gradient_accumulation_fusion = False
    expected = run(fused, x, GRIDS)[2]
    for linear in linears.values():
        linear.gradient_accumulation_fusion = True
        linear.weight.main_grad = torch.zeros_like(linear.weight)
        linear.weight.grad_added_to_main_grad = False
    run(fused, x, GRIDS)
    for name, linear in linears.items():
        assert linear.weight.grad_added_to_main_grad, name
        torch.testing.assert_close(linear.weight.main_grad, expected[f"{name}.weight"], rtol=1e-5, atol=1e-6)
