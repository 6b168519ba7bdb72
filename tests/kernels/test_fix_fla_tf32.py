"""IEEE fp32 on CUDA for a run that asks for it (qvl.kernels.fix_fla_tf32): the settings come and go with the block,
the switch applies fla's group only where the run asks on CUDA with fla and Gated DeltaNet layers, and the parity
check asks for it on CUDA in fp32. On a GPU with flash-linear-attention: the registry's fla entries exist at the
pinned version, and fla's chunked delta rule in fp32 is IEEE-exact only with them (a fresh process each way: Triton
refuses a kernel whose globals changed after it compiled)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from qvl.foundation import patches
from qvl.kernels import fix_fla_tf32, switch
from qvl.kernels.switch import Target


def _settings():
    return (
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
        os.environ.get(fix_fla_tf32.TRITON_DEFAULT),
    )


@pytest.mark.parametrize("triton_before", [None, "tf32"])
def test_the_settings_hold_for_the_block_and_come_back_after_it(monkeypatch, triton_before):
    if triton_before is None:
        monkeypatch.delenv(fix_fla_tf32.TRITON_DEFAULT, raising=False)
    else:
        monkeypatch.setenv(fix_fla_tf32.TRITON_DEFAULT, triton_before)
    before = _settings()
    assert before[1] != "ieee"  # torch's default rounds fp32 convolutions to TF32
    with fix_fla_tf32.arithmetic():
        assert _settings() == ("ieee", "ieee", "ieee")
    assert _settings() == before
    with pytest.raises(RuntimeError, match="inside"), fix_fla_tf32.arithmetic():
        raise RuntimeError("inside")
    assert _settings() == before
    with fix_fla_tf32.arithmetic(enabled=False):
        assert _settings() == before


def test_the_switch_applies_the_fla_group_only_where_the_run_asks_on_cuda_with_fla():
    asked = Target(device="cuda", fla=True, gated_delta_net=True, exact_fp32=True)
    assert fix_fla_tf32.PATCH_GROUP in switch.training_groups(asked)
    for other in (
        {"exact_fp32": False},  # training keeps fla's own precision
        {"device": "cpu"},  # qvl's torch kernels: no Triton
        {"fla": False},
        {"gated_delta_net": False},
    ):
        assert not switch.is_on(fix_fla_tf32.PATCH_GROUP, replace(asked, **other)), other
    # read from the config's qvl section
    config = SimpleNamespace(qvl=SimpleNamespace(exact_fp32=True), model=SimpleNamespace())
    assert Target.of(config, device="cuda").exact_fp32 is True
    assert Target.of(SimpleNamespace(model=SimpleNamespace()), device="cuda").exact_fp32 is False


def test_the_fp32_parity_check_asks_for_exact_fp32_on_cuda_only(tmp_path, monkeypatch):
    from qvl.foundation.families import get_family
    from qvl.training.parity import run as parity_run

    (tmp_path / "report.json").write_text('{"packed_sequences": 2, "seq_length": 200}')
    monkeypatch.setattr(parity_run, "fla_runs", lambda device: False)
    spec = parity_run.ParitySpec(hf_path=tmp_path, data=tmp_path, run_dir=tmp_path)
    family = get_family("qwen3_5_vl")
    assert parity_run.qvl_run(spec, family, "cuda").options["qvl.exact_fp32"] is True
    assert "qvl.exact_fp32" not in parity_run.qvl_run(spec, family, "cpu").options
    spec.precision = "bf16"
    assert "qvl.exact_fp32" not in parity_run.qvl_run(spec, family, "cuda").options


_FLA_FP32 = r"""
import json, sys, torch
from qvl.foundation import patches
from qvl.kernels import fix_fla_tf32, torch_gated_delta
from qvl.training.parity.exact import recurrent_delta_rule
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from tests.kernels.test_torch_gated_delta import _strong_decay_inputs
from tests.numerics import relative_error

exact = sys.argv[1] == "exact"
cu = torch.tensor([0, 300, 700, 1024], dtype=torch.int32, device="cuda")
inputs = [t.cuda() for t in _strong_decay_inputs(1024, 18.0)]
weight = torch.randn(1, 1024, 4, 16, device="cuda", dtype=torch.float64, generator=torch.Generator("cuda").manual_seed(0))

def run(rule, dtype):
    leaves = [t.to(dtype).clone().requires_grad_(True) for t in inputs]
    out, _ = rule(*leaves, cu_seqlens=cu)
    (out.double() * weight).sum().backward()
    return [out, *(t.grad for t in leaves)]

def fp64_rule(q, k, v, g, beta, cu_seqlens):  # the recurrence in float64 (the torch rule's computes in fp32)
    bounds = cu_seqlens.tolist()
    pieces = [recurrent_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta)))[0] for a, b in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=1), None

truth = run(fp64_rule, torch.float64)
torch_chunked = run(torch_gated_delta.chunk_gated_delta_rule, torch.float32)
with fix_fla_tf32.arithmetic(exact), patches.applied(*([fix_fla_tf32.PATCH_GROUP] if exact else [])):
    fla = run(chunk_gated_delta_rule, torch.float32)
names = ("out", "q", "k", "v", "g", "beta")
print(json.dumps({n: (relative_error(a, c), relative_error(b, c)) for n, a, b, c in zip(names, fla, torch_chunked, truth)}))
"""


def _fla_fp32_errors(mode: str) -> dict[str, tuple[float, float]]:
    """name -> (fla's, qvl's torch chunked rule's) relative error from fp64, fp32 inputs, in a fresh process."""
    import json

    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _FLA_FP32, mode], capture_output=True, text=True, timeout=300, check=False, cwd=root
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_the_fla_entries_exist_at_the_pinned_version_where_fla_is_installed():
    pytest.importorskip("fla")
    from tests.foundation.test_patches import check_patch_target, installed_here

    entries = [p for p in patches.PATCHES if p.group == fix_fla_tf32.PATCH_GROUP]
    assert entries and all(installed_here(p.version) for p in entries), [p.version for p in entries]
    for entry in entries:
        check_patch_target(entry)
    with patches.applied(fix_fla_tf32.PATCH_GROUP):
        from fla.ops.gated_delta_rule import chunk_fwd

        assert chunk_fwd.SOLVE_TRIL_DOT_PRECISION.value == "ieee"


@pytest.mark.gpu
def test_fla_in_fp32_stays_within_the_fp32_parity_gate_with_the_exact_settings(record_property):
    """fp32 on CUDA: flash-linear-attention's chunked delta rule (what Megatron-Core's GatedDeltaNet runs there) against
    the fp64 recurrence, with real layers' strong decays over three packed sequences. With qvl's exact-fp32 settings
    the output and the gradients of q, k, v and beta are within the fp32 parity check's gradient gate
    (training/parity/report.py), and the log-decay's gradient, of which the decay-gate parameters' gradients are made,
    is no further from fp64 than qvl's torch chunked rule's (on the CPU, these inputs: 1.8e-5 for it, ~2e-6 for the
    others). Both ways' errors are recorded (`bash benchmarks/gpu.sh run tests` writes them to gpu_tests.xml); by
    default fla rounds to TF32 on Ampere and later, ~1e-3 expected."""
    pytest.importorskip("fla")
    from qvl.training.parity.report import TOLERANCES

    exact, default = _fla_fp32_errors("exact"), _fla_fp32_errors("default")
    for name, (fla, torch_chunked) in exact.items():
        record_property(f"fp32 {name}: fla exact, fla default, torch chunked (relative error from fp64)",
                        (fla, default[name][0], torch_chunked))  # fmt: skip
    gate = TOLERANCES["fp32"].grad
    assert all(exact[name][0] <= gate for name in ("out", "q", "k", "v", "beta")), (gate, exact, default)
    assert exact["g"][0] <= 2 * exact["g"][1] + 1e-6, exact
