"""The lean HF vision tower (qvl.kernels.speed_hf_vision): transformers' numerics bit for bit on CPU, precomputed tower
inputs equal to the ones the tower derives, and a tower forward that reads nothing back from its tensors."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.foundation import patches
from qvl.kernels import compiled, speed_hf_vision
from qvl.kernels.tower_inputs import tower_inputs_for_config
from tests.numerics import assert_as_close_as_eager
from tests.tiny_megatron import tiny_megatron_model

HF_TOWER_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Two images and a two-frame video grid: several windows per image, a partial window at the edges.
GRIDS = torch.tensor([[1, 8, 12], [1, 4, 4], [2, 4, 8]])
# Tensor methods that read a value back to the host: a device sync when the tensor lives on a GPU.
HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor's value back into Python while active (and not paused)."""

    paused = False  # set by stand-in kernels whose own reads are not the code under test's

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS and not HostReads.paused:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def tiny_tower(family: str, dtype=torch.float32, attention: str = "sdpa"):
    """The family's tiny HF vision tower (random weights, norms and biases perturbed)."""
    import importlib

    from qvl.foundation.families import get_family
    from qvl.kernels.varlen_attention import _set_tower_attention

    config = tiny_hf_config(family).vision_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    record = get_family(family)
    module = importlib.import_module(f"transformers.models.{record.hf_module}.modeling_{record.hf_module}")
    tower = getattr(module, record.vision_tower_class)._from_config(config).to(dtype)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if name.endswith(("weight", "bias")) and param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    if attention != "sdpa":  # set after the build, as qvl does: transformers' build would look for a hub kernel
        _set_tower_attention(tower, attention)
    return tower


def plain_mlp_front(x, projections, activation):
    """An MLP's input projections called one by one and its activation region, as transformers' MLP runs
    (`activated_projections` sums Qwen2.5-VL's input gradient in its second GEMM, not transformers' bits)."""
    outputs = [projection(x) for projection in projections]
    return compiled.region(activation.fn, outputs[0])(*outputs)


def pixels(tower, dtype=torch.float32) -> torch.Tensor:
    config = tower.config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(GRIDS.prod(-1).sum()), width, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rms_norm_is_transformers_bit_for_bit(dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    norm = Qwen2_5_VLRMSNorm(1280).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(1280).to(dtype))
    x = torch.randn(2048, 1280, dtype=dtype, requires_grad=True)
    reference = norm(x)
    grads = torch.autograd.grad(reference.float().square().sum(), (x, norm.weight))
    with patches.applied(speed_hf_vision.GROUP):
        fused = norm(x)
        fused_grads = torch.autograd.grad(fused.float().square().sum(), (x, norm.weight))
    assert torch.equal(fused, reference)
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, grads))
    # The formulation matters: the weight inside torch's kernel rounds differently in bf16.
    inside = torch.nn.functional.rms_norm(x, (1280,), norm.weight, norm.variance_epsilon)
    assert dtype == torch.float32 or not torch.equal(inside, reference)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_rotary_is_transformers_bit_for_bit(family, dtype):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q, k = (torch.randn(512, 4, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    angles = torch.randn(512, 40)
    reference = module.apply_rotary_pos_emb_vision(q, k, angles.cos(), angles.sin())
    original = module.apply_rotary_pos_emb_vision
    with patches.applied(speed_hf_vision.GROUP):
        assert module.apply_rotary_pos_emb_vision is not original
        lean = module.apply_rotary_pos_emb_vision(q, k, angles.cos(), angles.sin())
    assert all(torch.equal(a, b) for a, b in zip(lean, reference))
    grads = torch.autograd.grad(sum(t.float().sum() for t in reference), (q, k))
    lean_grads = torch.autograd.grad(sum(t.float().sum() for t in lean), (q, k))
    assert all(torch.equal(a, b) for a, b in zip(lean_grads, grads))


@pytest.mark.slow  # three Inductor compilations for the CPU (~30 s on 2 cores)
def test_compiled_rotary_is_as_close_to_fp64_as_eager_and_compiles_once_for_every_patch_count():
    from torch._dynamo.utils import counters

    from benchmarks.bench_rotary_gpu import exact_rotary

    region = compiled.CompiledRegion(speed_hf_vision.rotary_fp32)  # what CUDA runs, compiled here for the CPU
    graphs = counters["stats"]["unique_graphs"]
    for n in (64, 96, 160):  # packs differ in patches: one graph, the patch count symbolic
        qkv = torch.randn(n, 3, 4, 40, dtype=torch.bfloat16, requires_grad=True)
        q, k, _ = qkv.unbind(1)  # the fused projection's strided views, as the lean attention passes them
        angles = torch.randn(n, 20).repeat(1, 2)
        fast, eager = (
            region(q, k, angles.cos(), angles.sin()),
            speed_hf_vision.rotary_fp32(q, k, angles.cos(), angles.sin()),
        )
        exact_qkv = qkv.detach().double().requires_grad_()
        eq, ek, _ = exact_qkv.unbind(1)
        exact = exact_rotary(eq, ek, angles.double().cos(), angles.double().sin())
        upstream = [torch.randn_like(e) for e in exact]
        for name, fast_out, eager_out, exact_out in zip("qk", fast, eager, exact, strict=True):
            assert_as_close_as_eager(fast_out, eager_out, exact_out, what=f"rotary {name}, {n} patches")
        exact_grads = torch.autograd.grad(exact, (eq, ek), upstream)
        as_bf16 = [u.bfloat16() for u in upstream]
        fast_grads = torch.autograd.grad(fast, (q, k), as_bf16)
        eager_grads = torch.autograd.grad(eager, (q, k), as_bf16)
        for name, a, b, c in zip("qk", fast_grads, eager_grads, exact_grads, strict=True):
            assert_as_close_as_eager(a, b, c, what=f"rotary gradient of {name}, {n} patches")
    assert counters["stats"]["unique_graphs"] == graphs + 1
    qkv = torch.randn(64, 3, 2, 40, dtype=torch.bfloat16)  # another head count: heads are a constant of the graph
    region(*qkv.unbind(1)[:2], angles[:64].cos(), angles[:64].sin())
    assert counters["stats"]["unique_graphs"] == graphs + 2


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_prepared_inputs_equal_what_the_tower_derives(family):
    tower = tiny_tower(family)
    x = pixels(tower)
    reference = tower(x, grid_thw=GRIDS).pooler_output
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    assert (inputs.window_index is not None) == (family == "qwen2_5_vl")  # Qwen2.5-VL windows its attention
    assert inputs.max_seqlen == 8 * 12  # the largest frame: full attention blocks are frames
    given = speed_hf_vision.tower_kwargs(inputs)
    assert {"position_ids", "cu_seqlens", speed_hf_vision.MAX_SEQLENS_KWARG} <= given.keys()
    lean = tower(x, grid_thw=GRIDS, **given).pooler_output
    assert torch.equal(lean, reference)
    with HostReads() as reads:
        tower(x, grid_thw=GRIDS)  # not given them: the tower derives its inputs itself, reading the grid back
    assert reads.reads


@pytest.fixture
def varlen_as_on_cuda(monkeypatch):
    """The attention path a CUDA device takes (torch's varlen kernel), with a CPU stand-in kernel that records the
    lengths it was given and runs each block through SDPA on tensors it reads with the counter paused."""
    from qvl.kernels import varlen_attention

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((type(max_q), type(max_k)))
        HostReads.paused = True  # the stand-in's own reads are not the tower's
        try:
            out = torch.empty_like(q)
            bounds = cu_q.tolist()
            for start, end in zip(bounds, bounds[1:]):
                out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                    *(t[start:end].transpose(0, 1) for t in (q, k, v)), scale=kwargs.get("scale")
                ).transpose(0, 1)
        finally:
            HostReads.paused = False
        return out

    monkeypatch.setattr(varlen_attention, "varlen_usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: (kernel, frozenset({"window_size", "scale"})))
    return calls


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_lean_tower_reads_nothing_back_on_the_cuda_path(family, varlen_as_on_cuda):
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    reference_tower = tiny_tower(family)
    tower = tiny_tower(family, attention=register_hf_varlen_attention())
    x = pixels(tower)
    reference = reference_tower(x, grid_thw=GRIDS).pooler_output
    with HostReads() as reads:
        derived = tower(x, grid_thw=GRIDS).pooler_output
    assert len(reads.reads) > tower.config.depth  # the unprepared tower reads the grid and every block's length
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    varlen_as_on_cuda.clear()
    with patches.applied(speed_hf_vision.GROUP):
        with HostReads() as reads:
            lean = tower(x, grid_thw=GRIDS, **speed_hf_vision.tower_kwargs(inputs)).pooler_output
            lean.float().sum().backward()
    assert reads.reads == []
    assert varlen_as_on_cuda == [(int, int)] * tower.config.depth  # every block got Python ints
    torch.testing.assert_close(lean, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(derived, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cuda_path", [True, False], ids=["varlen", "sdpa-loop"])
@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_lean_block_attention_and_mlp_are_transformers_bit_for_bit(family, cuda_path, request):
    """The lean block forward (the first residual add and the second norm as one region, the second add and the next
    block's first norm as another), attention forward (no permutes, no device max of the block lengths, the rotary's
    backward writing qkv's gradient) and MLP forward (the activation as one region) against transformers' forwards
    with the same attention function and inputs: outputs and every gradient bitwise equal, in bf16; only the first
    block's first norm runs as a module (the others' run inside the previous block's region). The gate and up
    projections run as two calls here: their input gradient's sum in one GEMM is one bf16 rounding fewer, not
    transformers' bits (tests/kernels/test_speed_hf_vision_block.py holds it against fp64)."""
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    if cuda_path:
        request.getfixturevalue("varlen_as_on_cuda")
    tower = tiny_tower(family, torch.bfloat16, attention=register_hf_varlen_attention())
    x = pixels(tower, torch.bfloat16)
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    results = []
    for lean in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(speed_hf_vision, "activated_projections", plain_mlp_front)
            if not lean:
                for factory in ("lean_block", "lean_attention", "lean_gated_mlp", "lean_mlp"):
                    patch.setattr(speed_hf_vision, factory, lambda original: original)
            calls, normed = [], []
            patch.setattr(torch.Tensor, "max", lambda self, *a, **k: calls.append(1) or torch.max(self, *a, **k))
            hooks = [
                b.norm1.register_forward_hook(lambda *_, i=i: normed.append(i)) for i, b in enumerate(tower.blocks)
            ]
            tower.zero_grad()
            with patches.applied(speed_hf_vision.GROUP):
                out = tower(x, grid_thw=GRIDS, **speed_hf_vision.tower_kwargs(inputs, tower)).pooler_output
                out.float().square().sum().backward()
            for hook in hooks:
                hook.remove()
        results.append((out, [p.grad.clone() for p in tower.parameters()], len(calls), normed))
    (lean_out, lean_grads, lean_maxes, lean_normed), (hf_out, hf_grads, hf_maxes, hf_normed) = results
    assert torch.equal(lean_out, hf_out)
    assert all(torch.equal(a, b) for a, b in zip(lean_grads, hf_grads, strict=True))
    assert lean_maxes == 0 and hf_maxes == tower.config.depth  # transformers' device max in every block
    assert lean_normed == [0] and hf_normed == list(range(tower.config.depth))


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_mlp_activation_takes_its_compiled_region_where_compiled_regions_run(family, monkeypatch):
    tower = tiny_tower(family)
    mlp = tower.blocks[0].mlp
    regions = []
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    monkeypatch.setattr(compiled, "compiled", lambda fn: regions.append(fn.__name__) or fn)
    x = torch.randn(7, tower.config.hidden_size if family == "qwen2_5_vl" else tower.config.embed_dim)
    with patches.applied(speed_hf_vision.GROUP):
        lean = mlp(x)
    assert regions == ["silu_gate" if family == "qwen2_5_vl" else "quick_gelu"]
    assert torch.equal(lean, mlp(x))  # transformers' forward, the group undone


def test_rms_norm_takes_its_compiled_region_where_compiled_regions_run(monkeypatch):
    norm = tiny_tower("qwen2_5_vl").blocks[0].norm1
    regions = []
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    monkeypatch.setattr(compiled, "compiled", lambda fn: regions.append(fn.__name__) or fn)
    x = torch.randn(7, norm.weight.shape[0])
    with patches.applied(speed_hf_vision.GROUP):
        lean = norm(x)
    assert regions == ["rms_norm"]
    assert torch.equal(lean, norm(x))  # transformers' forward, the group undone


@pytest.mark.gpu
@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_compiled_mlp_activation_matches_transformers_on_cuda_bf16(family):
    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    mlp = tiny_tower(family, torch.bfloat16).blocks[0].mlp.cuda()
    width = mlp.down_proj.out_features if family == "qwen2_5_vl" else mlp.fc2.out_features
    x = torch.randn(4096, width, device="cuda", dtype=torch.bfloat16)
    results = []
    for lean in (True, False):
        mlp.zero_grad()
        inputs = x.clone().requires_grad_()
        with patches.applied(speed_hf_vision.GROUP) if lean else contextlib.nullcontext():
            out = mlp(inputs)
        out.float().square().sum().backward()
        results.append((out.float(), inputs.grad.float(), [p.grad.float() for p in mlp.parameters()]))
    (out, grad, weights), (reference, reference_grad, reference_weights) = results
    torch.testing.assert_close(out, reference, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(grad, reference_grad, rtol=1.6e-2, atol=2e-2)
    for a, b in zip(weights, reference_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-2)


def test_tower_inputs_refuse_a_device_grid():
    grid = GRIDS.to("meta")
    with pytest.raises(ValueError, match="on the CPU"):
        tower_inputs_for_config(grid, tiny_hf_config("qwen2_5_vl").vision_config)


# --- GPU: the fused paths against transformers' unfused ones in bf16 (skipped without CUDA)


@pytest.mark.gpu
def test_compiled_rotary_matches_transformers_on_cuda_bf16():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as module

    q, k = (torch.randn(8192, 16, 80, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    angles = torch.randn(8192, 40, device="cuda").repeat(1, 2)
    reference = module.apply_rotary_pos_emb_vision(q, k, angles.cos(), angles.sin())
    with patches.applied(speed_hf_vision.GROUP):
        fused = module.apply_rotary_pos_emb_vision(q, k, angles.cos(), angles.sin())
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)  # one bf16 ulp: FMA contraction in the fp32 math
    grads = torch.autograd.grad(sum(t.float().square().sum() for t in reference), (q, k))
    fused_grads = torch.autograd.grad(sum(t.float().square().sum() for t in fused), (q, k))
    for a, b in zip(fused_grads, grads):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=2e-2)


@pytest.mark.gpu
def test_fused_rms_norm_matches_transformers_on_cuda_bf16():
    """Output and both gradients as close to fp64 as transformers' eager norm (bf16 on an H100 puts single elements
    one bf16 step apart, so the comparison is norm-wise against fp64: tests/numerics.py)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    norm = Qwen2_5_VLRMSNorm(1280).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x = torch.randn(16384, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # a random upstream gradient: with sum(y^2) the input gradient nearly cancels (the norm is scale-invariant)
    probe = torch.randn(x.shape, device="cuda", dtype=torch.float64)
    exact = copy.deepcopy(norm).double()
    x64 = x.detach().double().requires_grad_()
    reference = exact(x64)
    reference_grads = torch.autograd.grad((reference * probe).sum(), (x64, exact.weight))
    eager = norm(x)
    eager_grads = torch.autograd.grad((eager.double() * probe).sum(), (x, norm.weight))
    with patches.applied(speed_hf_vision.GROUP):
        fused = norm(x)
        fused_grads = torch.autograd.grad((fused.double() * probe).sum(), (x, norm.weight))
    assert_as_close_as_eager(fused, eager, reference, what="output")
    for name, a, b, ref in zip(("input", "weight"), fused_grads, eager_grads, reference_grads):
        assert_as_close_as_eager(a, b, ref, what=f"{name} gradient")


@pytest.mark.gpu
@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_lean_tower_matches_transformers_on_cuda_bf16(family):
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    reference_tower = tiny_tower(family, torch.bfloat16).cuda()
    tower = tiny_tower(family, torch.bfloat16, attention=register_hf_varlen_attention()).cuda()
    x = pixels(tower, torch.bfloat16).cuda()
    grid = GRIDS.cuda()
    reference = reference_tower(x, grid_thw=grid).pooler_output
    reference.float().square().sum().backward()
    inputs = tower_inputs_for_config(GRIDS, tower.config).to("cuda")
    with patches.applied(speed_hf_vision.GROUP):
        lean = tower(x, grid_thw=grid, **speed_hf_vision.tower_kwargs(inputs, tower)).pooler_output
        lean.float().square().sum().backward()
    torch.testing.assert_close(lean, reference, rtol=2e-2, atol=2e-2)
    reference_grads = dict(reference_tower.named_parameters())
    for name, param in tower.named_parameters():
        expected = reference_grads[name].grad.float()
        scale = expected.abs().max().clamp(min=1e-3)
        assert (param.grad.float() - expected).abs().max() <= 0.05 * scale, name


def test_loader_tower_inputs_reach_the_megatron_models_tower(tmp_path, cpu_runtime):
    """The loader computes each micro-batch's tower inputs in its workers; the training step's host batch hands them
    to the HF tower inside qvl's Qwen2.5-VL, whose output is unchanged (upstream's forward deriving them itself)."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.load import build_packed_datasets
    from qvl.data.prepare import PrepareConfig, prepare
    from qvl.data.samples import write_sample_dataset
    from qvl.foundation import distributed
    from qvl.training.step import host_batch, model_inputs

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=8, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen2_5_vl")
    prepare(
        PrepareConfig(
            input=jsonl, media_root=media, family="qwen2_5_vl", hf_path=hf, seq_length=512, output=tmp_path / "data"
        )
    )
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model("qwen2_5_vl", hf=hf)
        model.eval()
        assert patches.is_applied(speed_hf_vision.GROUP)  # the build's pre-wrap hook applied the lean tower
        config = dict(path=str(tmp_path / "data"), hf_path=str(hf), family="qwen2_5_vl", micro_batch_size=1)
        loader, _, _ = build_packed_datasets(type("DatasetConfig", (), {**config, "num_workers": 0}), None)
        batch = next(iter(loader))
        expected = tower_inputs_for_config(batch.image_grid_thw, hf_config.vision_config)
        assert torch.equal(batch.image_tower_inputs.window_index, expected.window_index)
        assert batch.image_tower_inputs.max_window_seqlen == expected.max_window_seqlen
        kwargs, _ = model_inputs(batch, torch.device("cpu"))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "loss_mask")}
        given = []
        with torch.no_grad():
            derived = model(**kwargs)
            model.visual.register_forward_pre_hook(lambda module, args, kw: given.append(sorted(kw)), with_kwargs=True)
            lean = model(**kwargs, host_batch=host_batch(model, batch, kwargs, torch.device("cpu")))
        assert given and "cu_window_seqlens" in given[0] and speed_hf_vision.MAX_SEQLENS_KWARG in given[0]
        assert torch.equal(lean, derived)
    finally:
        patches.undo(speed_hf_vision.GROUP)
        distributed.destroy_distributed()
