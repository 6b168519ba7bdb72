"""Qwen3.5-VL checkpoints as released: config fields `mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings:
false`, mRoPE section and partial rotary, and a multi-token-prediction head (`mtp.*`) that transformers does not
build. Qwen3.5 dense and MoE (per-expert MTP experts), Qwen3.6 (packed experts) and Qwen3.8 tiny checkpoints import
into Megatron-Core's MTP block built from local specs, verify (main and MTP logits against the published MTP head,
qvl.bridges.mtp_reference) and export back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qvl.bridges import convert
from qvl.bridges.mtp_reference import checkpoint_mtp_names, mtp_layers_in_checkpoint
from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.foundation.distributed import run_on_ranks
from qvl.foundation.errors import ConversionError
from tests.bridges import conversion_jobs

# name -> (family, release): Qwen3.5 dense and MoE (per-expert MTP experts), Qwen3.6 MoE (experts packed, main layers
# and MTP) and dense, Qwen3.8 dense (its reasoning_effort template renders verify's prompt)
CHECKPOINTS = {
    "dense": ("qwen3_5_vl", None),
    "moe": ("qwen3_5_vl_moe", None),
    "moe_3.6": ("qwen3_5_vl_moe", "3.6"),
    "dense_3.6": ("qwen3_5_vl", "3.6"),
    "dense_3.8": ("qwen3_5_vl", "3.8"),
}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, by name."""
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def without_mtp_head(hf: Path, *, in_config: bool = False) -> Path:
    """The HF checkpoint at `hf` as transformers saves it (its `mtp.*` tensors dropped) or, with `in_config`, as
    built without an MTP head (no `mtp_num_hidden_layers` in its config either)."""
    weights = load_file(str(hf / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(hf / "model.safetensors"))
    if in_config:
        config = json.loads((hf / "config.json").read_text())
        del config["text_config"]["mtp_num_hidden_layers"]
        (hf / "config.json").write_text(json.dumps(config))
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    """Each checkpoint written, imported, verified and exported (one set of processes for each stage)."""
    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf = {
        name: str(write_tiny_hf_checkpoint(root / "hf" / name, family, seed=3, release=release))
        for name, (family, release) in CHECKPOINTS.items()
    }
    run_on_ranks(conversion_jobs.import_all, hf, str(root / "megatron"), cpu=True)
    (reports,) = run_on_ranks(conversion_jobs.verify_all, hf, str(root / "megatron"), cpu=True)
    run_on_ranks(conversion_jobs.export_all, str(root / "megatron"), list(hf), str(root / "export"), cpu=True)
    return {
        name: {"hf": Path(hf[name]), "report": reports[name], "export": root / "export" / name} for name in CHECKPOINTS
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_released_fields_and_mtp_tensors_convert_and_verify_within_fp32_rounding(converted, name):
    case = converted[name]
    text = json.loads((case["hf"] / "config.json").read_text())["text_config"]
    assert text["mtp_num_hidden_layers"] == 1 and text["mtp_use_dedicated_embeddings"] is False
    assert text["rope_parameters"]["mrope_section"] and text["partial_rotary_factor"] == 0.25
    report = case["report"]
    assert report["ok"] and report["tensors_different"] == [] and report["tensors_kept_aside"] == [], report
    assert report["max_abs_diff"] <= 1e-6 and report["mtp_max_abs_diff"] <= 1e-6, report
    assert report["mtp_top1_agreement"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_export_round_trips_every_tensor_bit_for_bit_mtp_included(converted, name):
    original, exported = tensors(converted[name]["hf"]), tensors(converted[name]["export"])
    assert sorted(exported) == sorted(original)
    assert [n for n in original if not torch.equal(original[n], exported[n])] == []
    family, release = CHECKPOINTS[name]
    packed = any(n.endswith("experts.gate_up_proj") for n in exported)
    assert checkpoint_mtp_names(converted[name]["export"]) and packed == (family.endswith("moe") and release == "3.6")


def test_a_config_with_mtp_layers_but_no_tensors_imports_without_them(tmp_path):
    hf = without_mtp_head(write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl", seed=1))
    assert mtp_layers_in_checkpoint(hf, 1) == 0


def test_an_mtp_layer_count_the_tensors_do_not_hold_is_named(tmp_path):
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl", seed=1)
    with pytest.raises(ConversionError, match=r"mtp_num_hidden_layers=2, but its mtp\.\* tensors hold 1 layer"):
        mtp_layers_in_checkpoint(hf, 2)


def test_import_refuses_the_count_mismatch_before_building_anything(tmp_path):
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl", seed=1)
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="set text_config.mtp_num_hidden_layers to 1"):
        run_on_ranks(convert.import_on_rank, str(hf), str(tmp_path / "out"), "fp32", cpu=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel=2), dict(pipeline_parallel=2)])
def test_mtp_logits_verify_at_tensor_and_pipeline_parallel_two(converted, layout, tmp_path):
    """The MTP block split over two TP ranks (dense and MoE), or on the last of two pipeline stages (its own copy of
    the embedding there, the vision features sent from the first stage: qvl.bridges.mtp_inputs): the same logits as
    the published head's, on inputs with images and a video."""
    names = ["dense", "moe"] if "tensor_parallel" in layout else ["dense"]
    hf = {name: str(converted[name]["hf"]) for name in names}
    root = converted[names[0]]["hf"].parent.parent / "megatron"
    reports = [r for r in run_on_ranks(conversion_jobs.verify_all, hf, str(root), cpu=True, **layout) if r]
    for name in names:
        report = next(r[name] for r in reports if r.get(name))
        assert report["ok"] and report["mtp_max_abs_diff"] <= 1e-6 and report["tensors_different"] == [], report
