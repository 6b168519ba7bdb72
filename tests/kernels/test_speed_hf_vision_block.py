"""The HF vision block's fused tail (qvl.kernels.speed_hf_vision: `lean_block`'s add-and-norm region, `RotaryQKV`'s
qkv gradient region): where compiled regions run, the block calls them and nothing outside them stacks qkv's
gradient; eagerly transformers' outputs and gradients bit for bit; compiled, as close to fp64 as eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.foundation import patches
from qvl.kernels import compiled, hf_vision_mlp, speed_hf_vision
from qvl.kernels.tower_inputs import tower_inputs_for_config
from tests.kernels.test_speed_hf_vision import GRIDS, HF_TOWER_FAMILIES, pixels, plain_mlp_front, tiny_tower
from tests.numerics import assert_as_close_as_eager


class OpsOutsideRegions(TorchDispatchMode):
    """The aten ops run while active, but those inside a region (`inside` set by the stand-in `compiled`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def counting_regions(regions: list[str], mode: OpsOutsideRegions):
    """A stand-in for `compiled.compiled`: each region call recorded in `regions`, its ops hidden from `mode`."""

    def stand_in(fn):
        def run(*args):
            regions.append(fn.__name__)
            mode.inside = True
            try:
                return fn(*args)
            finally:
                mode.inside = False

        return run

    return stand_in


def unfused_rotated_qkv(qkv, cos, sin):
    """The rotary region on `unbind`'s views, as before `RotaryQKV`: autograd stacks the three gradients."""
    q, k, v = qkv.unbind(1)
    return (*compiled.region(speed_hf_vision.rotary_fp32, q)(q, k, cos, sin), v)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_block_and_rotary_take_their_compiled_regions_where_compiled_regions_run(family, monkeypatch):
    """Where compiled regions run, a block calls the add-and-norm region once, and its attention the rotary region
    forward and the qkv gradient region backward, outside which its backward runs no `stack` (transformers':
    `unbind`'s backward); outputs and gradients are transformers'. The compiled regions' own kernels are counted by
    the step census (benchmarks/compiled_regions.py)."""
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    block = tiny_tower(family, attention=register_hf_varlen_attention()).blocks[0]
    inputs = tower_inputs_for_config(GRIDS, block.attn.config)
    rows = int(GRIDS.prod(-1).sum())
    angles = torch.randn(rows, block.attn.head_dim // 2).repeat(1, 2)
    call = {"cu_seqlens": inputs.cu_seqlens, "position_embeddings": (angles.cos(), angles.sin())}
    call[speed_hf_vision.MAX_SEQLENS_KWARG] = speed_hf_vision.tower_kwargs(inputs)[speed_hf_vision.MAX_SEQLENS_KWARG]
    x = torch.randn(rows, block.norm1.weight.shape[0])
    probe = torch.randn(rows, block.norm1.weight.shape[0])
    results = {}
    for lean in (True, False):
        regions, mode = [], OpsOutsideRegions()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiled, "runs_compiled", lambda tensor: True)
            patch.setattr(compiled, "compiled", counting_regions(regions, mode))
            patch.setattr(speed_hf_vision, "activated_projections", plain_mlp_front)  # its own tests: below
            if not lean:
                patch.setattr(speed_hf_vision, "lean_block", lambda original: original)
                patch.setattr(speed_hf_vision, "rotated_qkv", unfused_rotated_qkv)
            inputs_x = x.clone().requires_grad_()
            block.zero_grad()
            with patches.applied(speed_hf_vision.GROUP):
                out = block(inputs_x, **call)
                with mode:
                    (out * probe).sum().backward()
        results[lean] = (out, inputs_x.grad, [p.grad.clone() for p in block.parameters()], regions, mode.ops)
    out, grad, weights, regions, ops = results[True]
    hf_out, hf_grad, hf_weights, hf_regions, hf_ops = results[False]
    norm = "add_rms_norm" if family == "qwen2_5_vl" else "add_layer_norm"
    assert [r for r in regions if r not in ("rms_norm", "silu_gate", "quick_gelu")] == [
        "rotary_fp32",
        norm,
        "rotary_qkv_gradient",
    ]
    # transformers' block: norm2 its own region (Qwen2.5-VL's RMSNorm; Qwen2-VL's LayerNorm is one kernel eagerly)
    unfolded = {"add_rms_norm": "rms_norm", "add_layer_norm": None, "rotary_qkv_gradient": None}
    assert hf_regions == [unfolded.get(r, r) for r in regions if unfolded.get(r, r)]
    assert "stack" not in ops and "stack" in hf_ops  # unbind's backward, folded into rotary_qkv_gradient
    assert torch.equal(out, hf_out) and torch.equal(grad, hf_grad)
    assert all(torch.equal(a, b) for a, b in zip(weights, hf_weights, strict=True))


def test_qkv_bias_gradient_is_summed_in_the_rotary_gradient_region(monkeypatch):
    """With DDP's `main_grad` (the tower's `MainGradLinear` qkv projection): where compiled regions run, the
    attention's backward calls the qkv gradient region that also sums the projection's bias gradient, and no
    bias-gradient region reads it back; the outputs, the input's gradient and every `main_grad` are the linear then
    `RotaryQKV`'s bit for bit (fp32). A plain linear with a `main_grad` (the fusion off) takes the unfused path."""
    from qvl.kernels.torch_wgrad_accum import MainGradLinear

    heads, head_dim, hidden, rows = 4, 16, 64, 40

    def qkv_linear(main_grad_linear: bool = True) -> torch.nn.Linear:
        torch.manual_seed(7)
        linear = torch.nn.Linear(hidden, 3 * heads * head_dim)
        for param in linear.parameters():
            param.main_grad, param.grad_added_to_main_grad = torch.zeros_like(param), False
        if main_grad_linear:
            linear.__class__ = MainGradLinear
        return linear

    angles = torch.randn(rows, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    x, probes = torch.randn(rows, hidden), [torch.randn(rows, heads, head_dim) for _ in range(3)]

    def run(linear, projected: bool) -> tuple[torch.Tensor, ...]:
        inputs = x.clone().requires_grad_()
        if projected:
            outputs = speed_hf_vision.projected_rotated_qkv(inputs, linear, heads, cos, sin)
        else:
            outputs = speed_hf_vision.rotated_qkv(linear(inputs).view(rows, 3, heads, -1), cos, sin)
        sum((output * probe).sum() for output, probe in zip(outputs, probes, strict=True)).backward()
        return (*outputs, inputs.grad, linear.weight.main_grad.clone(), linear.bias.main_grad.clone())

    regions, mode = [], OpsOutsideRegions()
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    monkeypatch.setattr(compiled, "compiled", counting_regions(regions, mode))
    linear = qkv_linear()
    projected = run(linear, True)
    assert regions == ["rotary_fp32", "rotary_qkv_gradient_and_sum"]
    assert linear.weight.grad_added_to_main_grad and linear.bias.grad_added_to_main_grad
    regions.clear()
    reference = run(qkv_linear(), False)
    assert sorted(regions) == ["bias_gradient_into", "rotary_fp32", "rotary_qkv_gradient"]  # the linear's own sum
    assert all(torch.equal(a, b) for a, b in zip(projected, reference, strict=True))
    assert projected[-1].abs().sum() > 0  # the bias gradient arrived
    plain = qkv_linear(main_grad_linear=False)
    q, *_ = speed_hf_vision.projected_rotated_qkv(x.requires_grad_(), plain, heads, cos, sin)
    assert q.grad_fn.name() != "ProjectedRotaryQKVBackward"


def check_block_regions_against_fp64(device: str, *, sizes: tuple[int, ...], norms: tuple[str, ...]) -> None:
    """The add-and-norm regions and the qkv gradient region compiled (for `device`) against fp64: outputs and
    gradients as close as the eager functions, and one graph for every patch count."""
    from torch._dynamo.utils import counters

    from benchmarks.bench_rotary_gpu import exact_rotary

    width, heads, head_dim = 80, 4, 16  # no size equal to a row count: Dynamo would guard on the equality
    add_norms = {"rms": speed_hf_vision.add_rms_norm, "layer": speed_hf_vision.add_layer_norm}
    regions = {name: compiled.CompiledRegion(add_norms[name]) for name in norms}
    gradient_region = compiled.CompiledRegion(speed_hf_vision.rotary_qkv_gradient)
    summing_region = compiled.CompiledRegion(speed_hf_vision.rotary_qkv_gradient_and_sum)
    # graphs compiled by earlier tests of this process would be reused where their guards hold: counted from none
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float64).to(dtype)

    for n in sizes:
        for name, region in regions.items():
            params = [1 + 0.1 * randn(width)] + ([0.1 * randn(width)] if name == "layer" else [])
            residual, delta = randn(n, width), randn(n, width)
            probes = [randn(n, width, dtype=torch.float64) for _ in range(2)]
            results = []
            for fn, dtype in ((region, torch.bfloat16), (add_norms[name], torch.bfloat16), (add_norms[name], None)):
                leaves = [t.detach().to(dtype or torch.float64).requires_grad_() for t in (*params, residual, delta)]
                outputs = fn(*leaves, 1e-6)
                grads = torch.autograd.grad(sum((o.double() * p).sum() for o, p in zip(outputs, probes)), leaves)
                results.append((*outputs, *grads))
            gradients = [f"{p} gradient" for p in ("weight", "bias")[: len(params)] + ("residual", "delta")]
            for label, fast, eager, exact in zip(["sum", "normed", *gradients], *results, strict=True):
                assert_as_close_as_eager(fast, eager, exact, what=f"add {name} norm {label}, {n} rows")
        grads = [randn(n, heads, head_dim) for _ in range(3)]
        angles = randn(n, head_dim // 2, dtype=torch.float32).repeat(1, 2)
        exact_q, exact_k = (torch.zeros(n, heads, head_dim, device=device, dtype=torch.float64,
                                        requires_grad=True) for _ in range(2))  # fmt: skip
        rotated = exact_rotary(exact_q, exact_k, angles.double().cos(), angles.double().sin())
        exact = torch.stack((*torch.autograd.grad(rotated, (exact_q, exact_k), [g.double() for g in grads[:2]]),
                             grads[2].double()), dim=1)  # fmt: skip
        fast = gradient_region(*grads, angles.cos(), angles.sin())
        eager = speed_hf_vision.rotary_qkv_gradient(*grads, angles.cos(), angles.sin())
        assert fast.shape == (n, 3, heads, head_dim)
        assert_as_close_as_eager(fast, eager, exact, what=f"qkv gradient, {n} patches")
        # with the qkv projection's bias gradient: the same gradient, and its fp32 column sum
        summed, column_sum = summing_region(*grads, angles.cos(), angles.sin())
        assert column_sum.dtype == torch.float32
        assert_as_close_as_eager(summed, eager, exact, what=f"qkv gradient beside its sum, {n} patches")
        eager_sum = eager.reshape(n, -1).sum(0, dtype=torch.float32)
        assert_as_close_as_eager(column_sum, eager_sum, exact.reshape(n, -1).sum(0), what=f"qkv bias sum, {n} patches")
    assert counters["stats"]["unique_graphs"] == graphs + len(regions) + 2  # one graph each for every size


@pytest.mark.slow  # Inductor compilations for the CPU (~20 s on 2 cores)
def test_compiled_block_regions_are_as_close_to_fp64_as_eager_for_every_patch_count():
    check_block_regions_against_fp64("cpu", sizes=(64, 96), norms=("rms",))


@pytest.mark.gpu
def test_compiled_block_regions_are_as_close_to_fp64_as_eager_on_cuda():
    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    check_block_regions_against_fp64("cuda", sizes=(4096, 6144, 10240), norms=("rms", "layer"))


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_a_towers_blocks_hand_their_last_add_to_the_next_blocks_first_norm(family, monkeypatch):
    """With its call's `ResidualCarry`, where compiled regions run, each block's last residual add and the next
    block's first norm are one add-and-norm region: an eager `add` fewer per block boundary forward (backward, the
    sum of the two gradients of a block's input becomes the region's: the step census counts a region's backward,
    benchmarks/compiled_regions.py); the outputs and gradients of the tower are those of the tower without the
    carry, bit for bit."""
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    tower = tiny_tower(family, attention=register_hf_varlen_attention())
    inputs = tower_inputs_for_config(GRIDS, tower.config)
    x = pixels(tower)
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    results = {}
    for carried in (True, False):
        regions, mode = [], OpsOutsideRegions()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiled, "compiled", counting_regions(regions, mode))
            tower.zero_grad()
            given = speed_hf_vision.tower_kwargs(inputs, tower if carried else None)
            assert (speed_hf_vision.CARRY_KWARG in given) is carried
            with patches.applied(speed_hf_vision.GROUP):
                with mode:
                    out = tower(x, grid_thw=GRIDS, **given).pooler_output
                    forward_adds = mode.ops.count("add")
                    out.square().sum().backward()
        results[carried] = (out, [p.grad.clone() for p in tower.parameters()], regions, forward_adds)
    out, grads, regions, forward_adds = results[True]
    plain_out, plain_grads, plain_regions, plain_forward_adds = results[False]
    norm = "add_rms_norm" if family == "qwen2_5_vl" else "add_layer_norm"
    boundaries = tower.config.depth - 1
    assert regions.count(norm) == plain_regions.count(norm) + boundaries == 2 * tower.config.depth - 1
    assert forward_adds == plain_forward_adds - boundaries
    assert torch.equal(out, plain_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_a_carry_skips_recomputed_and_compiled_blocks_and_hands_over_only_its_own_tensor():
    """A block that reruns in backward must see what its first run saw, and a compiled block fuses inside itself:
    the carry joins only two consecutive blocks that are neither, and a tower without such a pair takes none. It
    hands the normed sum over only to the block whose input is that sum, and only once."""
    from qvl.bridges.providers import RecomputeVisionTowers

    tower = tiny_tower("qwen2_5_vl")
    carry = speed_hf_vision.ResidualCarry.for_tower(tower)
    assert carry.next_norms == {block: after.norm1 for block, after in zip(tower.blocks, tower.blocks[1:])}
    total, normed, other = torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    carry.handed = (total, normed)
    assert carry.take(other) is None and carry.take(total) is None  # another tensor: nothing, and the hand-over ends
    carry.handed = (total, normed)
    assert carry.take(total) is normed and carry.take(total) is None
    RecomputeVisionTowers(blocks=1)([tower])
    assert list(speed_hf_vision.ResidualCarry.for_tower(tower).next_norms) == list(tower.blocks[1:-1])
    RecomputeVisionTowers()([tower])
    assert speed_hf_vision.ResidualCarry.for_tower(tower) is None
    assert speed_hf_vision.CARRY_KWARG not in speed_hf_vision.tower_kwargs(
        tower_inputs_for_config(GRIDS, tower.config), tower
    )
    compiled_tower = tiny_tower("qwen2_vl")
    for block in compiled_tower.blocks[1:]:
        block.compile(backend="eager")
    assert speed_hf_vision.ResidualCarry.for_tower(compiled_tower) is None


def test_with_its_first_blocks_recomputed_the_carried_tower_trains_as_the_plain_one():
    """Vision recompute of the first two blocks (their reruns in backward see no carry, as their first runs did),
    the last two carried: outputs and gradients equal the tower's without the carry, bit for bit (Qwen2.5-VL's tiny
    tower: four blocks; Qwen2-VL's has two)."""
    from qvl.bridges.providers import RecomputeVisionTowers
    from qvl.kernels.varlen_attention import register_hf_varlen_attention

    tower = tiny_tower("qwen2_5_vl", attention=register_hf_varlen_attention()).train()
    RecomputeVisionTowers(blocks=2)([tower])
    inputs, x = tower_inputs_for_config(GRIDS, tower.config), pixels(tower)
    results = []
    for carried in (tower, None):
        tower.zero_grad()
        given = speed_hf_vision.tower_kwargs(inputs, carried)
        assert (speed_hf_vision.CARRY_KWARG in given) is (carried is not None)
        with patches.applied(speed_hf_vision.GROUP):
            out = tower(x, grid_thw=GRIDS, **given).pooler_output
            out.square().sum().backward()
        results.append((out, [p.grad.clone() for p in tower.parameters()]))
    (out, grads), (plain_out, plain_grads) = results
    assert torch.equal(out, plain_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


# The MLPs' input projections and activations: Qwen2.5-VL's gate and up with SiLU-gating, Qwen2-VL's fc1 with QuickGELU.
MLP_FRONTS = {"qwen2_5_vl": (2, hf_vision_mlp.SILU_GATE), "qwen2_vl": (1, hf_vision_mlp.QUICK_GELU)}


def _mlp_front(family: str, dtype: torch.dtype = torch.float32, seed: int = 5) -> tuple[torch.nn.Linear, ...]:
    """The family's MLP input projections at toy widths."""
    torch.manual_seed(seed)
    return tuple(torch.nn.Linear(64, 96, dtype=dtype) for _ in range(MLP_FRONTS[family][0]))


def _run_mlp_front(projections, x, fused: bool) -> tuple[torch.Tensor, ...]:
    """The activation, the input's gradient and the parameters' (`.grad`, else `main_grad`) under a fixed loss:
    `activated_projections` or transformers' composition (the projections one by one, then the activation)."""
    activation = hf_vision_mlp.SILU_GATE if len(projections) == 2 else hf_vision_mlp.QUICK_GELU
    x = x.detach().clone().requires_grad_()
    if fused:
        out = hf_vision_mlp.activated_projections(x, projections, activation)
    else:
        out = activation.fn(*(projection(x) for projection in projections))
    out.double().sin().sum().backward()
    params = [p for projection in projections for p in projection.parameters()]
    grads = [(p.grad if getattr(p, "main_grad", None) is None else p.main_grad).clone() for p in params]
    for projection in projections:
        projection.zero_grad(set_to_none=True)
    return out, x.grad, *grads


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_mlp_input_projections_sum_the_input_gradient_in_the_gemms(family):
    """`activated_projections` against the projections called one by one and the activation: output, weight and bias
    gradients bit for bit. With two projections (Qwen2.5-VL) the input's gradient is one GEMM and one `addmm_` into
    its result, no eager add (fp32: the same sum in another order; bf16: one rounding instead of two, at least as
    close to float64 as autograd's sum); with one (Qwen2-VL) it is bit for bit too, in bf16."""
    projections = _mlp_front(family)
    x = torch.randn(3, 50, 64)
    with OpsOutsideRegions() as fused_ops:
        fused = _run_mlp_front(projections, x, True)
    with OpsOutsideRegions() as plain_ops:
        plain = _run_mlp_front(projections, x, False)
    two = len(projections) == 2
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        if i == 1 and two:  # the input's gradient
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b), i
    assert fused_ops.ops.count("addmm_") == int(two) and "addmm_" not in plain_ops.ops
    assert fused_ops.ops.count("add") == plain_ops.ops.count("add") - int(two)  # autograd's sum of the two

    projections, x = tuple(p.bfloat16() for p in projections), x.bfloat16()
    fused, plain = _run_mlp_front(projections, x, True), _run_mlp_front(projections, x, False)
    if not two:
        assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))
        return
    exact_projections = tuple(copy.deepcopy(p).double() for p in projections)
    exact = _run_mlp_front(exact_projections, x.double(), False)[1]
    assert not torch.equal(fused[1], plain[1])
    assert_as_close_as_eager(fused[1], plain[1], exact, what="bf16 input gradient", slack=1.0)


@pytest.mark.parametrize("family", HF_TOWER_FAMILIES)
def test_mlp_bias_gradients_are_summed_in_the_activations_gradient_region(family, monkeypatch):
    """With DDP's `main_grad` (the HF tower's `MainGradLinear`s): where compiled regions run, the backward calls one
    region that writes the projections' output gradients and sums them into their bias gradients, and no
    bias-gradient region reads them back; every `main_grad` is what the linears called one by one give, bit for bit
    (fp32). Plain `nn.Linear`s with a `main_grad` (the fusion off) return their gradients to autograd."""
    from qvl.kernels.torch_wgrad_accum import MainGradLinear

    def linears(main_grad_linear: bool):
        modules = _mlp_front(family, seed=6)
        for module in modules:
            for param in module.parameters():
                param.main_grad, param.grad_added_to_main_grad = torch.zeros_like(param), False
            if main_grad_linear:
                module.__class__ = MainGradLinear
        return modules

    activation = MLP_FRONTS[family][1]
    regions: list[str] = []
    mode = OpsOutsideRegions()
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    monkeypatch.setattr(compiled, "compiled", counting_regions(regions, mode))
    x = torch.randn(40, 64)
    fused_modules = linears(True)
    with mode:
        fused = _run_mlp_front(fused_modules, x, True)
    assert regions == [activation.fn.__name__, activation.gradient_and_sums.__name__]
    assert all(p.grad_added_to_main_grad for m in fused_modules for p in m.parameters())
    regions.clear()
    reference = _run_mlp_front(linears(True), x, False)
    assert regions.count("bias_gradient_into") == len(fused_modules)  # the linears' own: each reads its gradient
    for a, b in zip(fused[2:], reference[2:], strict=True):
        assert torch.equal(a, b)
    plain_modules = linears(False)
    _run_mlp_front(plain_modules, x, True)
    assert not any(p.grad_added_to_main_grad or p.main_grad.any() for m in plain_modules for p in m.parameters())


def test_mlp_input_projections_that_are_not_plain_linears_are_called_as_they_are():
    gate_proj, up_proj = _mlp_front("qwen2_5_vl")
    adapter = torch.nn.Sequential(gate_proj)  # an adapter around the linear, as PEFT wraps one
    x = torch.randn(7, 64)
    out = hf_vision_mlp.activated_projections(x, (adapter, up_proj), hf_vision_mlp.SILU_GATE)
    assert torch.equal(out, hf_vision_mlp.silu_gate(gate_proj(x), up_proj(x)))
    assert out.grad_fn.name() != "ActivatedProjectionsBackward"


@pytest.mark.gpu
def test_gate_and_up_projections_into_main_grad_are_as_close_to_fp64_as_eager_on_cuda():
    """bf16 on CUDA, the tower's `MainGradLinear`s with fp32 `main_grad`s: `activated_projections` (compiled
    activation and gradient-and-sums regions, `addmm_`) against the linears called one by one with the activation
    eagerly, both against float64, at Qwen2.5-VL's vision widths; input gradient and every `main_grad`."""
    from qvl.kernels.torch_wgrad_accum import MainGradLinear

    if not compiled.cuda_compile_usable():
        pytest.skip("needs Triton")
    torch.manual_seed(0)
    modules = [torch.nn.Linear(1280, 3456, device="cuda") for _ in range(2)]
    x = torch.randn(4096, 1280, device="cuda")

    def run(dtype, fused: bool):
        gate_proj, up_proj = (copy.deepcopy(m).to(dtype) for m in modules)
        for module in (gate_proj, up_proj):
            module.__class__ = MainGradLinear
            for param in module.parameters():
                param.main_grad = torch.zeros(
                    param.shape, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32
                )
                param.grad_added_to_main_grad = False
        out = _run_mlp_front((gate_proj, up_proj), x.to(dtype), fused)
        return out[1], *out[2:]

    exact = run(torch.float64, False)
    fused, eager = run(torch.bfloat16, True), run(torch.bfloat16, False)
    names = ("input gradient", "gate weight", "gate bias", "up weight", "up bias")
    for name, a, b, ref in zip(names, fused, eager, exact, strict=True):
        assert_as_close_as_eager(a, b, ref, what=name)
