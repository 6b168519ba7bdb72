"""HF <-> Megatron conversion for every family record (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5-VL,
Qwen3.5-VL-MoE): logit parity, per-tensor export equality, the one streamed checkpoint loaded at TP=1, TP=2 and PP=2
(two gloo processes; Qwen3.5's DeltaNet heads split over TP, its DeltaNet and attention layers over PP), and the
errors users hit.

Tolerance: fp32 logits on CPU must agree to 1e-6. Measured: Qwen2-VL and Qwen2.5-VL 0 (bit-identical),
Qwen3-VL 2.7e-7, Qwen3-VL-MoE 4.2e-7, Qwen3.5-VL 1.8e-7 (2.4e-7 at TP=2), Qwen3.5-VL-MoE 2.1e-7 - summation-order
noise of fp32 (the text-only path alone shows 2e-7). Two images of different sizes, multi-turn text and a 4-frame
video go through every model.
"""

from __future__ import annotations

import pytest
import torch

from qvl.bridges import convert
from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.foundation.distributed import run_on_ranks
from qvl.foundation.families import FAMILIES
from tests.bridges import conversion_jobs
from tests.bridges.load_defects import skipped_vision, swapped_experts

PARITY = 1e-6


@pytest.fixture(scope="module")
def hf_paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {family: str(write_tiny_hf_checkpoint(root / family, family, seed=1)) for family in FAMILIES}


@pytest.fixture(scope="module")
def imported(hf_paths, tmp_path_factory) -> str:
    """Every family imported once (streamed, one process); the tests load it at different layouts."""
    out = tmp_path_factory.mktemp("megatron")
    run_on_ranks(conversion_jobs.import_all, hf_paths, str(out), cpu=True)
    return str(out)


def _assert_parity(report: dict) -> None:
    assert report["max_abs_diff"] <= PARITY, report
    assert report["top1_agreement"] == 1.0
    assert report["tensors_compared"] > 50 and report["tensors_different"] == [], report["tensors_different"][:5]
    assert report["tokens"] > 60  # two images + video + text really went through


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_verify_export_round_trip(family, hf_paths, imported, tmp_path):
    from transformers import AutoModelForImageTextToText

    hf_path = hf_paths[family]
    (report,) = run_on_ranks(conversion_jobs.verify_all, {family: hf_path}, imported, cpu=True)
    _assert_parity(report[family])
    # check=False: the tensors are compared below (the export's logit check has a test of its own)
    run_on_ranks(convert.export_on_rank, f"{imported}/{family}", str(tmp_path / "export"), None, False, cpu=True)
    original = AutoModelForImageTextToText.from_pretrained(hf_path, dtype=torch.float32).state_dict()
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).state_dict()
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


def test_export_is_checked_against_the_checkpoint_loaded_as_training_resumes(imported, tmp_path, monkeypatch):
    """`qvl convert export` compares the written checkpoint (transformers, fp32) with the model loaded from the
    checkpoint the way training resumes it (qvl.bridges.trained), not with the model the export built: a defect in
    the export's own load (the vision tower skipped, two experts swapped) writes a wrong checkpoint and fails."""
    checkpoint = f"{imported}/qwen3_vl_moe"
    (result,) = run_on_ranks(convert.export_on_rank, checkpoint, str(tmp_path / "ok"), cpu=True)
    assert result["check"]["ok"] and result["check"]["max_abs_diff"] <= PARITY, result["check"]
    for defect in (skipped_vision, swapped_experts):
        monkeypatch.setattr(convert, "load_megatron", defect(convert.load_megatron))
        (result,) = run_on_ranks(convert.export_on_rank, checkpoint, str(tmp_path / defect.__name__), cpu=True)
        assert not result["check"]["ok"] and result["check"]["max_abs_diff"] > 1e-3, (defect.__name__, result)
        monkeypatch.undo()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["tp2", "pp2"])
def test_two_process_conversion_matches_hf(layout, hf_paths, imported):
    ranks = run_on_ranks(conversion_jobs.verify_all, hf_paths, imported, cpu=True, **layout)
    for family in FAMILIES:
        reports = [r[family] for r in ranks if r[family] is not None]
        assert len(reports) == 1, f"{family}: exactly one rank reports"
        _assert_parity(reports[0])


def test_errors_name_the_problem_and_the_fix(hf_paths, tmp_path):
    with pytest.raises(convert.ConversionError, match="no config.json"):
        convert.check_hf_dir(tmp_path)
    with pytest.raises(convert.ConversionError, match="not a directory"):
        convert.check_hf_dir(tmp_path / "missing")
    provider = type(
        "P",
        (),
        dict(
            tensor_model_parallel_size=3,
            pipeline_model_parallel_size=1,
            num_attention_heads=4,
            num_query_groups=2,
            num_layers=4,
        ),
    )()
    with pytest.raises(
        convert.ConversionError,
        match=r"tensor_parallel=3 does not divide the checkpoint's 4 attention heads .*use tensor_parallel=1 or 2",
    ):
        convert.check_checkpoint_layout(provider)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = 1, 3
    with pytest.raises(
        convert.ConversionError,
        match=r"pipeline_parallel=3 does not divide the checkpoint's 4 layers.*use pipeline_parallel=1, 2 or 4",
    ):
        convert.check_checkpoint_layout(provider)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["Qwen2ForCausalLM"],
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="Qwen2VLForConditionalGeneration.*Qwen3VLMoeForConditionalGeneration"):
        convert.require_qwen_vl(tmp_path)


def test_missing_mrope_section_is_named():
    from qvl.bridges.fixes import MissingConfigField, mrope_section

    text = type("T", (), {"rope_parameters": {"rope_theta": 1e6}, "hidden_size": 64, "num_attention_heads": 4})()
    with pytest.raises(MissingConfigField, match="mrope_section"):
        mrope_section(text)
