"""`qvl verify-training` on PEFT recipes (qvl.training.parity.adapters): a qvl LoRA / DoRA step is the step
transformers + peft take from the same initial adapters, fp32 on CPU, on Qwen2.5-VL (language model, HF vision tower
and merger; DoRA on the biased fused qkv), Qwen3.5-VL (Gated DeltaNet and gated attention, Megatron vision tower) and
Qwen3-VL-MoE (every expert's adapters, as peft's LoRA on transformers' fused 3-D expert parameters).
"""

from __future__ import annotations

import json

import pytest

from qvl.training.parity.report import TOLERANCES

STEPS = 3
OPTIONS = {"seq_length": 200, "lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 1, "weight_decay": 0.1}
ADAPTERS = {"adapter_rank": 8, "adapter_alpha": 16}
CASES = {
    "qwen2_5_vl-lora": ("qwen2_5_vl", "qwen2_5_vl_3b_peft", {"adapter_targets": "language,vision,merger"}),
    "qwen2_5_vl-dora": ("qwen2_5_vl", "qwen2_5_vl_3b_peft", {"adapter": "dora"}),
    "qwen3_5_vl-lora": ("qwen3_5_vl", "qwen3_5_vl_9b_peft", {"adapter_targets": "language,vision,merger"}),
    "qwen3_vl_moe-experts": ("qwen3_vl_moe", "qwen3_vl_30b_a3b_peft", {"adapter_targets": "language,experts"}),
}


@pytest.fixture(scope="module")
def parity_data(tmp_path_factory):
    """family -> (tiny HF checkpoint, the parity dataset prepared with it)."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity-peft")
    data = {}
    for family in {family for family, _, _ in CASES.values()}:
        hf = write_tiny_hf_checkpoint(root / family / "hf", family)
        data[family] = (hf, prepare_parity_dataset(hf, family, root / family, seq_length=OPTIONS["seq_length"]))
    return data


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_adapter_gradients_and_trajectory_match_transformers_with_peft(parity_data, tmp_path, case):
    from qvl.launchers.cli import main

    family, recipe, options = CASES[case]
    hf, data = parity_data[family]
    overrides = [f"{k}={v}" for k, v in {**OPTIONS, **ADAPTERS, **options}.items()]
    args = ["verify-training", str(hf), "--data", str(data), "--recipe", recipe, "--steps", str(STEPS)]
    args += [
        "--run-dir",
        str(tmp_path / "run"),
        "--report",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "p.png"),
    ]
    status = main([*args, *overrides])
    report = json.loads((tmp_path / "r.json").read_text())
    tol = TOLERANCES["fp32"]
    assert status == 0 and report["ok"], report["failures"]
    # the adapters alone, under peft's names: A and B of every adapted HF module (DoRA: and its magnitude)
    assert report["tensors_compared"] >= 40
    assert all(".lora_" in name for name in (report["grad_worst"], report["weight_worst"]))
    assert report["grad_max_rel_diff"] <= tol.grad and report["weight_max_diff"] <= tol.weight * report["peak_lr"]
    assert report["steps"][-1]["loss_qvl"] < report["steps"][0]["loss_qvl"]  # the adapters learned something
    notes = " ".join(report["deliberate"])
    assert ("DoRA" if "dora" in case else "LoRA") + " rank 8, alpha 16" in notes and "tied into one parameter" in notes
    if "experts" in case:  # every MoE layer's gate_up_proj and down_proj, under peft's ParamWrapper names
        assert "and 8 fused expert parameters" in notes, notes
    # MoE: the load-balancing loss at the recipe's coefficient on both sides, its value compared at every step
    balance = [(r["moe_aux_loss_qvl"], r["moe_aux_loss_hf"]) for r in report["steps"]]
    if family.endswith("_moe"):
        assert "MoE load balancing: both sides added" in notes and "moe_aux_loss_coeff=0.001" in notes, notes
        assert all(ours is not None and ref is not None and ref > 0 for ours, ref in balance), balance
        assert max(r["moe_aux_loss_rel_diff"] for r in report["steps"]) <= tol.step_loss
    else:
        assert balance == [(None, None)] * STEPS


@pytest.mark.slow
def test_a_reference_with_half_the_load_balancing_coefficient_fails_the_check(parity_data, tmp_path, monkeypatch):
    """The PEFT reference adding Megatron-Core's load-balancing loss at half the recipe's coefficient: the loss's
    value, compared with its coefficient, names it at step 1 (the adapters' gradients, which the frozen routers' loss
    steers, differ too: 3e-3 relative on the tiny model; a value compared over the coefficient would not)."""
    from qvl.training.parity.moe_aux import MoeAuxReference
    from qvl.training.parity.run import ParitySpec, run_parity

    attach = MoeAuxReference.attach.__func__
    halved = lambda cls, model, *, kind, coeff: attach(cls, model, kind=kind, coeff=coeff / 2)  # noqa: E731
    monkeypatch.setattr(MoeAuxReference, "attach", classmethod(halved))
    family, recipe, options = CASES["qwen3_vl_moe-experts"]
    hf, data = parity_data[family]
    spec = ParitySpec(
        hf_path=hf,
        data=data,
        run_dir=tmp_path,
        recipe=recipe,
        steps=1,
        options={**OPTIONS, **ADAPTERS, **options, "warmup_iters": 0},
    )
    report = run_parity(spec)
    assert "step 1 load-balancing loss differs by 1 (rel)" in report.failures, report.failures


def test_parallel_layouts_and_dropout_are_refused_for_a_peft_check():
    from types import SimpleNamespace

    from qvl.foundation.errors import ConfigError
    from qvl.training.parity.adapters import take_adapters

    def config(dropout: float = 0.0):
        return SimpleNamespace(peft=SimpleNamespace(dropout=dropout, targets=["language"]))

    assert take_adapters(SimpleNamespace(peft=None), {}) is None
    with pytest.raises(ConfigError, match=r"runs on one process .*'tensor_parallel': 2"):
        take_adapters(config(), {"tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"adapter_dropout=0.1: the two frameworks draw different dropout masks"):
        take_adapters(config(0.1), {})
