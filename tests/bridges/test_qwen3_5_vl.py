"""Qwen3.5-VL checkpoints with multi-token-prediction tensors (`mtp.*`, as the released ones carry): qvl does not
convert them (its local specs build no MTP layers) but carries them through import and export bit for bit
(qvl.bridges.unconverted), and `verify` reports them as kept aside, never as silently lost."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qvl.bridges import convert
from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.bridges.unconverted import UNCONVERTED_FILE
from qvl.foundation.distributed import run_on_ranks
from tests.bridges import conversion_jobs

MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}


def test_mtp_tensors_are_kept_through_import_and_export_and_named_by_verify(tmp_path):
    from transformers import AutoModelForImageTextToText

    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl", seed=2)
    weights = load_file(str(hf / "model.safetensors"))
    mtp = {name: torch.randn(shape) for name, shape in MTP.items()}
    save_file(weights | mtp, str(hf / "model.safetensors"), metadata={"format": "pt"})
    megatron = tmp_path / "megatron"
    run_on_ranks(conversion_jobs.import_all, {"qwen3_5_vl": str(hf)}, str(megatron), cpu=True)
    (reports,) = run_on_ranks(conversion_jobs.verify_all, {"qwen3_5_vl": str(hf)}, str(megatron), cpu=True)
    report = reports["qwen3_5_vl"]
    assert report["max_abs_diff"] <= 1e-6 and report["ok"], report
    assert report["tensors_kept_aside"] == sorted(MTP) and report["tensors_different"] == []

    run_on_ranks(convert.export_on_rank, str(megatron / "qwen3_5_vl"), str(tmp_path / "export"), cpu=True)
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[name] for name in MTP} == {UNCONVERTED_FILE} and len(index) == len(weights) + len(MTP)
    with safe_open(str(tmp_path / "export" / UNCONVERTED_FILE), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(name), tensor) for name, tensor in mtp.items())
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    assert all(torch.equal(exported.state_dict()[name], tensor) for name, tensor in weights.items())
