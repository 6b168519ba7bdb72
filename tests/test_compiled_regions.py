"""`benchmarks/compiled_regions.py`: the step census counts a region that runs compiled on CUDA as the kernels
Inductor generates for it (compiled on the CPU), forward and backward, instead of its eager ops."""

from __future__ import annotations

import torch

from benchmarks.compiled_regions import LABEL, CompiledRegions, RegionKernels, inductor_kernels, kernel_calls
from benchmarks.op_costs import WidthMap
from benchmarks.step_census import Census
from qvl.kernels.speed_hf_vision import rotary_fp32


def test_a_pointwise_region_is_one_kernel_each_way():
    x, y = (torch.randn(64, 32, requires_grad=True) for _ in range(2))
    kernels = inductor_kernels(lambda a, b: (a * b + 1.0).sin() * 2.0, (x, y), {})
    assert kernels.forward == 1
    assert kernels.backward == 1  # cos, the products and both input gradients in one loop
    assert kernels.graphs == 2


def test_kernel_calls_count_generated_kernels_and_fallbacks_not_gemms():
    code = """
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r'''...''')
triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', '''...''')
def call(self, args):
        primals_1, = args
        cpp_fused_add_0(primals_1, buf0)
        extern_kernels.mm(buf0, primals_1, out=buf1)
        triton_poi_fused_mul_1.run(buf1, buf2, 64, stream=stream0)
        buf3 = torch.ops.aten.nonzero.default(buf2)
        buf4 = torch.ops.aten.view.default(buf3, [-1])
        cpp_fused_add_0(buf4, buf5)
"""
    assert kernel_calls(code) == 4  # two calls of one kernel, the Triton kernel, the nonzero fallback


def _census_of_one_call(fn, q, k, cos, sin, regions=None) -> Census:
    census = Census(WidthMap(dims={}))
    region = regions(census).region("vision rotary", fn) if regions else fn
    grads = [torch.ones_like(q), torch.ones_like(k)]
    q.grad = k.grad = None  # a gradient accumulated into (`add_`) would be an op outside the region
    with census.tracking(), census.counted():
        out = region(q, k, cos, sin)
        torch.autograd.backward(out, grads)
    return census


def test_the_rotary_region_counts_inductors_kernels_fewer_than_its_eager_ops():
    q, k = (torch.randn(128, 4, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    angles = torch.randn(128, 8).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    eager = _census_of_one_call(rotary_fp32, q, k, cos, sin).summary(1)
    census = _census_of_one_call(rotary_fp32, q, k, cos, sin, regions=CompiledRegions)
    compiled = census.summary(1)
    stats = compiled["compiled_regions"]["vision rotary"]
    assert stats["count"] == LABEL
    assert (stats["forward_runs"], stats["backward_runs"]) == (1, 1)
    # every op of the call and of its backward is inside the region: the census counts Inductor's kernels alone
    kernels = stats["forward_kernels"] + stats["backward_kernels"]
    assert compiled["step"]["ops"] == {"compiled-region:vision rotary": kernels}
    assert compiled["step"]["view_ops"] == 2  # the two leaves' AccumulateGrad (a detach each), outside the region
    assert kernels < eager["step"]["kernel_launching_ops"]
    assert stats["forward_kernels"] < 8 <= eager["step"]["kernel_launching_ops"] // 2  # 8 eager ops forward in bf16
    # bytes, what the generated graphs move: q, k, cos, sin read and q', k' written forward; backward reads the
    # output gradients, cos and sin (not q and k: the rotary is linear in them) and writes the input gradients; the
    # first-half mask (head_dim bools) is written forward and read backward
    read, written, mask = sum(t.nbytes for t in (q, k, cos, sin)), 2 * q.nbytes, q.shape[-1]
    backward = 2 * q.nbytes + cos.nbytes + sin.nbytes + written
    assert census.regions["other"].nongemm_bytes == (read + written + mask) + (backward + mask)


def test_graph_bytes_read_each_argument_once_and_write_a_gradient_returned_twice_once():
    """A residual add and a norm (qvl's `add_rms_norm`): forward reads both addends and the weight and writes the sum,
    the normed sum and the rows' inverse RMS (saved for backward); backward reads both output gradients, the saved sum,
    inverse RMS and weight and writes ONE gradient for both addends, and the weight's."""
    from qvl.kernels.speed_hf_vision import add_rms_norm

    rows, width = 100, 80
    weight = torch.ones(width, dtype=torch.bfloat16, requires_grad=True)
    residual, delta = (torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    kernels = inductor_kernels(add_rms_norm, (weight, residual, delta, 1e-6), {})
    unit, rstd = rows * width * 2, rows * 4  # a [rows, width] bf16 tensor; [rows, 1] fp32
    assert kernels.forward_bytes == 2 * unit + weight.nbytes + 2 * unit + rstd
    assert kernels.backward_bytes == 3 * unit + rstd + weight.nbytes + unit + weight.nbytes
    # the census's widths: every size mapped (here width 80 -> 1280) before the bytes are summed
    wide = inductor_kernels(
        add_rms_norm,
        (weight, residual, delta, 1e-6),
        {},
        shape=lambda dims: tuple(1280 if d == width else d for d in dims),
    )
    assert wide.forward_bytes == 16 * (4 * unit + weight.nbytes) + rstd


def _adds_outside_regions(used_outside: bool, monkeypatch) -> dict[str, int]:
    """The eager ops of one backward through a region that uses its input three times (`(a * a).sin() + a`), with
    the input also used outside the region or not (the region's own kernels stubbed: what is counted outside it is
    the question here)."""
    from benchmarks import compiled_regions

    monkeypatch.setattr(compiled_regions, "inductor_kernels_apart", lambda *a, **k: RegionKernels(forward=1, backward=1,
                        graphs=2))  # fmt: skip
    census = Census(WidthMap(dims={}))
    region = CompiledRegions(census).region("thrice", lambda a: (a * a).sin() + a)
    leaf = torch.randn(64, 32, requires_grad=True)
    with census.tracking(), census.counted():
        a = leaf * 2.0  # its gradients are summed in this node's buffer
        losses = [region(a).sum()] + ([a.exp().sum()] if used_outside else [])
        torch.autograd.backward(losses)
    ops = census.summary(1)["step"]["ops"]
    assert ops["compiled-region:thrice"] == 2
    return {name: count for name, count in ops.items() if name in ("add", "add_")}


def test_the_engines_sum_of_a_regions_gradient_with_one_from_outside_is_eager(monkeypatch):
    """A region's input used three times inside it gets one gradient from its compiled backward on CUDA (AOTAutograd
    sums the three): no eager sum. Used outside too, autograd's engine adds that gradient to the outside one with a
    kernel of its own: one eager `add`. On the CPU the engine sums each of the region's three pieces as it arrives,
    under the region's nodes; the census counts one of those sums, the first with the outside gradient in it."""
    assert _adds_outside_regions(False, monkeypatch) == {}
    assert sum(_adds_outside_regions(True, monkeypatch).values()) == 1
