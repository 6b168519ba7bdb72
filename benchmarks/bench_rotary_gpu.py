"""The HF vision tower's rotary (Qwen2-VL / Qwen2.5-VL) on a GPU: bytes moved per second, forward and backward.

On an H100 (benchmarks/RESULTS.md, 2026-11-26) the compiled vision rotary region took 480 us per forward call for
about 100 MB, some 10x under the memory bandwidth, and 3x longer than its own backward. This benchmark times, at the
census shapes (10,240 patches x 16 heads x 80, bf16; q and k the fused qkv projection's strided views, as the lean
attention hands them over; cos and sin fp32 per patch), each of:
- `eager`: transformers' `apply_rotary_pos_emb_vision`;
- `stacked_all_dynamic`: the region as it ran on 2026-11-26 (q and k stacked, rotate-half by `cat`, every size
  symbolic);
- `swapped_all_dynamic`: qvl's formulation now (`qvl.kernels.speed_hf_vision.rotary_fp32`: one pass per tensor, the
  halves swapped by index, the sign in the sine) with every size symbolic;
- `region`: that function as a compiled region (`qvl.kernels.compiled.CompiledRegion`: only the patch count
  dynamic), its backward autograd's through the region;
- `region_qkv`: the rotary as qvl runs it (`qvl.kernels.speed_hf_vision.RotaryQKV`): the same region forward, and
  backward one region (`rotary_qkv_gradient`) that writes the fused qkv projection's gradient from those of q, k
  and v, where the others leave `unbind`'s `stack` to a kernel of its own (not timed for them).
Each figure is the device time per call over `--repeats` calls after warm-up (CUPTI's kernel intervals: the host's
time between calls does not count), with the kernels each call ran; bytes are what the op must read and write
(forward: q, k, cos, sin read, both outputs written; backward: the output gradients, cos, sin read, the input
gradients written: for `region_qkv` v's gradient read and qkv's whole gradient written too), over the GPU's nominal
HBM bandwidth. Each variant's result is also held to an fp64 reference (norm-wise; tests/numerics.py). The goal
(issue 38): the rotary as qvl runs it (`region_qkv`) at >= 60% of HBM bandwidth both ways.

`python -m benchmarks.bench_rotary_gpu` on a GPU (`bash benchmarks/gpu.sh run rotary`); `--tiny` runs small
shapes on the CPU, eagerly (the harness check of the suite and of `gpu.sh rehearse`): no speed figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.step_anatomy import busy_seconds, device_intervals

GOAL_BANDWIDTH_SHARE = 0.60
# Nominal HBM bandwidth, bytes/s, by the planner's GPU kinds (vendor data sheets: H100 SXM HBM3, H200 HBM3e, A100 SXM).
HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12}
SHAPES = {"census": dict(patches=10240, heads=16, dim=80), "tiny": dict(patches=256, heads=4, dim=40)}


def rotary_stacked(q, k, cos, sin):
    """qvl's vision rotary as it ran on the H100 on 2026-11-26 (kept here to measure against): q and k stacked into
    one tensor, rotate-half by concatenation, fp32."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    x = torch.stack((q, k)).float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out = ((x * cos) + (rotated * sin)).to(q.dtype)
    return out[0], out[1]


QKV_VARIANTS = frozenset({"region_qkv"})  # variants taking `[patches, 3, heads, dim]` qkv, not its q and k views
GOAL_VARIANT = "region_qkv"


def variants(device: torch.device) -> dict[str, Callable]:
    """The rotaries to time, by name: `fn(q, k, cos, sin) -> (q, k)`, or for QKV_VARIANTS `fn(qkv, cos, sin) ->
    (q, k, v)`; on the CPU every one runs eagerly (no speed figure there: qvl's regions run eagerly)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    from qvl.kernels import compiled
    from qvl.kernels.speed_hf_vision import RotaryQKV, rotary_fp32

    eager = apply_rotary_pos_emb_vision  # transformers' own: this process applies no patch group
    if device.type != "cuda":
        return {"eager": eager, "region_qkv": RotaryQKV.apply, "region": rotary_fp32,
                "stacked_all_dynamic": rotary_stacked, "swapped_all_dynamic": rotary_fp32}  # fmt: skip
    # the goal's pair first (eager, then qvl's as training runs it): each variant compiles cold, and a run cut off by
    # its time limit keeps the variants done (`on_variant` writes them)
    return {
        "eager": eager,
        "region_qkv": RotaryQKV.apply,  # its regions through qvl.kernels.compiled, as in training
        "region": compiled.CompiledRegion(rotary_fp32),
        "stacked_all_dynamic": torch.compile(rotary_stacked, dynamic=True, fullgraph=True),
        "swapped_all_dynamic": torch.compile(rotary_fp32, dynamic=True, fullgraph=True),
    }


def _call(name: str, fn: Callable, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(outputs, the tensors their gradients are taken for) of one call of variant `name`."""
    if name in QKV_VARIANTS:
        return fn(qkv, cos, sin), (qkv,)
    q, k, _ = qkv.unbind(1)
    return fn(q, k, cos, sin), (q, k)


def inputs(shape: dict, device: torch.device, seed: int = 0):
    """q and k as views of one fused qkv projection output, cos and sin as the tower computes them (fp32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    patches, heads, dim = shape["patches"], shape["heads"], shape["dim"]
    qkv = torch.randn(patches, 3, heads, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
    angles = (torch.rand(patches, dim // 2, generator=gen) * 64).repeat(1, 2).to(device)
    return qkv, angles.cos(), angles.sin()


def bytes_moved(shape: dict, *, qkv: bool = False) -> dict[str, int]:
    """Bytes the op must move each way: bf16 q, k and their results, fp32 cos and sin; with `qkv` backward also v's
    gradient read and written into qkv's."""
    tensor = shape["patches"] * shape["heads"] * shape["dim"] * 2
    tables = 2 * shape["patches"] * shape["dim"] * 4
    return {"forward": 4 * tensor + tables, "backward": (6 if qkv else 4) * tensor + tables}


def _device_seconds(work: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """(seconds the device was busy during `work`, kernels it ran): CUPTI's kernel intervals on CUDA, so the host's
    own time between calls (a compiled function's guards, autograd) does not count; wall seconds on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        work()
        return time.perf_counter() - start, 0
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with profiler:
        work()
        torch.cuda.synchronize()
    intervals = device_intervals(profiler)
    return busy_seconds(intervals), len(intervals)


def measure(name: str, fn: Callable, shape: dict, device: torch.device, repeats: int) -> dict:
    """Device seconds per forward call and per backward call of variant `name`, and kernels per call (two warm-up
    calls first, which also compile)."""
    qkv, cos, sin = inputs(shape, device)
    for _ in range(2):
        outputs, targets = _call(name, fn, qkv, cos, sin)
        torch.autograd.grad(outputs, targets, [torch.ones_like(o) for o in outputs])
    results: list = []
    forward, forward_kernels = _device_seconds(
        lambda: results.extend(_call(name, fn, qkv, cos, sin) for _ in range(repeats)), device
    )
    grads = [torch.ones_like(o) for o in results[0][0]]

    def backward() -> None:
        for outputs, targets in results:
            torch.autograd.grad(outputs, targets, grads)

    backward_s, backward_kernels = _device_seconds(backward, device)
    return {"forward_s": forward / repeats, "backward_s": backward_s / repeats,
            "kernels_per_call": {"forward": forward_kernels / repeats, "backward": backward_kernels / repeats}}  # fmt: skip


def exact_rotary(q, k, cos, sin):
    """transformers' rotate-half math in fp64 (the reference)."""
    half = q.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotate = lambda x: torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # noqa: E731
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def fp64_errors(name: str, fn: Callable, shape: dict, device: torch.device) -> dict[str, float]:
    """Norm-wise relative error of variant `name`'s outputs and input gradients against the fp64 evaluation of the
    same math."""
    qkv, cos, sin = inputs(shape, device, seed=1)
    exact_qkv = qkv.detach().double().requires_grad_()
    eq, ek, ev = exact_qkv.unbind(1)
    (outputs, targets), exact = _call(name, fn, qkv, cos, sin), exact_rotary(eq, ek, cos.double(), sin.double())
    exact = (*exact, ev) if name in QKV_VARIANTS else exact
    weights = [torch.randn_like(e) for e in exact]  # a random upstream gradient
    grads = torch.autograd.grad(outputs, targets, [w.to(o.dtype) for w, o in zip(weights, outputs, strict=True)])
    exact_grads = torch.autograd.grad(exact, (exact_qkv,) if name in QKV_VARIANTS else (eq, ek), weights)
    error = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return {
        "forward": max(error(a, b) for a, b in zip(outputs, exact, strict=True)),
        "backward": max(error(a, b) for a, b in zip(grads, exact_grads, strict=True)),
    }


def gpu_bandwidth() -> tuple[str | None, float | None]:
    """The planner's GPU kind for this device and its nominal HBM bytes/s (None off the known GPUs and on CPU)."""
    if not torch.cuda.is_available():
        return None, None
    name = torch.cuda.get_device_name().lower()
    kind = next((k for k in HBM_BYTES_PER_S if k in name), None)
    return kind, HBM_BYTES_PER_S.get(kind)


def benchmark(
    shape_name: str, repeats: int, device: torch.device, on_variant: Callable[[dict], None] | None = None
) -> dict:
    """Every variant's times, bandwidths and fp64 errors, and the goal checks of the region; `on_variant(results)`
    after each variant (the results so far, their checks once the goal's pair is measured)."""
    shape = SHAPES[shape_name]
    kind, peak = gpu_bandwidth() if device.type == "cuda" else (None, None)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "gpu_kind": kind,
               "hbm_bytes_per_s": peak, "shape": shape, "bytes": bytes_moved(shape),
               "bytes_qkv": bytes_moved(shape, qkv=True), "variants": {}, "checks": []}  # fmt: skip
    for name, fn in variants(device).items():
        moved = bytes_moved(shape, qkv=name in QKV_VARIANTS)
        row = measure(name, fn, shape, device, repeats)
        for way in ("forward", "backward"):
            row[f"{way}_us"] = round(row.pop(f"{way}_s") * 1e6, 2)
            row[f"{way}_bytes_per_s"] = round(moved[way] / (row[f"{way}_us"] / 1e6))
            row[f"{way}_bandwidth_share"] = round(row[f"{way}_bytes_per_s"] / peak, 3) if peak else None
        errors = fp64_errors(name, fn, shape, device)
        row["fp64_error"] = {way: float(f"{value:.3g}") for way, value in errors.items()}
        results["variants"][name] = row
        results["checks"] = goal_checks(results["variants"])
        if on_variant is not None:
            on_variant(results)
    return results


def goal_checks(rows: dict) -> list[dict]:
    """The goal variant's bandwidth shares and fp64 errors against eager's (none before both are measured)."""
    if GOAL_VARIANT not in rows or "eager" not in rows:
        return []
    checks, region, eager = [], rows[GOAL_VARIANT], rows["eager"]
    for way in ("forward", "backward"):
        share = region[f"{way}_bandwidth_share"]
        if share is not None:
            checks.append({"figure": f"vision rotary {way} as qvl runs it: share of HBM bandwidth",
                           "value": share, "goal": f">= {GOAL_BANDWIDTH_SHARE}",
                           "met": share >= GOAL_BANDWIDTH_SHARE})  # fmt: skip
        fast, slow = region["fp64_error"][way], eager["fp64_error"][way]
        checks.append({"figure": f"vision rotary {way} as qvl runs it: fp64 error / eager's", "value":
                       round(fast / slow, 3) if slow else None, "goal": "<= 1.25",
                       "met": fast <= 1.25 * slow + 1e-6})  # fmt: skip
    return checks


def table(results: dict) -> str:
    """One line per variant."""
    lines = [
        f"vision rotary on {results['device']}, {results['shape']}, bytes {results['bytes']} "
        f"({', '.join(sorted(QKV_VARIANTS))}: {results['bytes_qkv']})"
    ]
    for name, row in results["variants"].items():
        lines.append(
            f"  {name:20s} fwd {row['forward_us']:9.1f} us ({row['forward_bandwidth_share']} of HBM)  "
            f"bwd {row['backward_us']:9.1f} us ({row['backward_bandwidth_share']} of HBM)  fp64 error {row['fp64_error']}"
        )
    lines += [
        f"  {'MET ' if c['met'] else 'FAIL'} {c['figure']}: {c['value']} (goal {c['goal']})" for c in results["checks"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; writes OUT/bench_rotary_gpu.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant (median)")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU, eagerly (harness check)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("error: the census shapes need a CUDA GPU; pass --tiny to check the harness on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_rotary_gpu.json"
    results = benchmark("tiny" if args.tiny else "census", args.repeats, device,
                        on_variant=lambda so_far: path.write_text(json.dumps(so_far, indent=2)))  # fmt: skip
    print(table(results))
    print(f"wrote {args.out / 'bench_rotary_gpu.json'}")
    return 0


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the census shapes on CUDA; on CPU, a result saying it needs a GPU."""
    if not torch.cuda.is_available():
        results = {"why": "needs a CUDA GPU (the compiled region runs on CUDA only)", "variants": {}, "checks": []}
    else:
        results = benchmark("census", 5 if quick else 20, torch.device("cuda"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_rotary_gpu.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main())
