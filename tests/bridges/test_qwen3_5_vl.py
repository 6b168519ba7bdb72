"""Qwen3.5-VL checkpoints with multi-token-prediction tensors (`mtp.*`, as the released ones carry): qvl converts the
model without them and `verify` names every one as not exported, so such a conversion never passes silently."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.foundation.distributed import run_on_ranks
from tests.bridges import conversion_jobs

MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}


def test_verify_names_the_mtp_tensors_it_did_not_convert(tmp_path):
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl", seed=2)
    weights = load_file(str(hf / "model.safetensors"))
    weights.update({name: torch.randn(shape) for name, shape in MTP.items()})
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    run_on_ranks(conversion_jobs.import_all, {"qwen3_5_vl": str(hf)}, str(tmp_path / "megatron"), cpu=True)
    (reports,) = run_on_ranks(conversion_jobs.verify_all, {"qwen3_5_vl": str(hf)}, str(tmp_path / "megatron"), cpu=True)
    report = reports["qwen3_5_vl"]
    assert report["max_abs_diff"] <= 1e-6  # the model itself converted
    assert sorted(report["tensors_different"]) == [f"{name} (never exported)" for name in sorted(MTP)]
    assert not report["ok"]
