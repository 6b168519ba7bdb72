"""`qvl convert` checks a checkpoint's consistency first, and verifies one without
tokenizer or processor files from its config alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qvl.bridges.consistency import check_hf_checkpoint
from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.launchers.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("consistency")
    return {family: write_tiny_hf_checkpoint(root / family, family) for family in ("qwen2_5_vl", "qwen3_vl")}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_consistent_checkpoint_passes(tiny):
    files = check_hf_checkpoint(tiny["qwen2_5_vl"])
    assert files.tokenizer and files.processor


def test_tokenizer_image_pad_id_differs_from_config(tiny, tmp_path, capsys):
    hf = copy(tiny["qwen2_5_vl"], tmp_path / "hf")
    edit_json(hf / "config.json", image_token_id=7)
    assert main(["convert", "verify", str(hf), str(tmp_path / "megatron")]) == 2
    err = capsys.readouterr().err
    assert "the tokenizer maps <|image_pad|> to id 5 but config.json has image_token_id=7" in err
    assert "Traceback" not in err


def test_processor_of_another_family(tiny, tmp_path, capsys):
    hf = copy(tiny["qwen2_5_vl"], tmp_path / "hf")
    shutil.copy(tiny["qwen3_vl"] / "preprocessor_config.json", hf / "preprocessor_config.json")
    assert main(["convert", "import", str(hf), str(tmp_path / "megatron"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "preprocessor_config.json: patch_size=16 but config.json's vision_config.patch_size=14" in err
    assert not (tmp_path / "megatron").exists()


def test_verify_without_processor_files_builds_inputs_from_the_config(tiny, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):  # what save_pretrained of the model alone writes
        shutil.copy(tiny["qwen2_5_vl"] / name, hf / name)
    megatron = tmp_path / "megatron"
    assert main(["convert", "import", str(hf), str(megatron), "--dtype", "fp32", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["convert", "verify", str(hf), str(megatron), "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)  # stdout is the report alone (Megatron's prints go to stderr)
    assert report["ok"] and report["max_abs_diff"] < 1e-4 and report["tokens"] > 30
