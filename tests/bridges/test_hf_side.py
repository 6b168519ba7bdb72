"""A run's HF side: `qvl train` keeps the pretrained checkpoint's `hf/` folder (config, tokenizer, processor, kept-aside
tensors, tensor names) with its checkpoints, so `qvl convert export RUN OUT` needs nothing copied by hand; a run
without one is told the flag that gives it, and so is its export; adapter_config.json names its base."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from qvl.bridges.checkpoints import HF_FILES_DIR, LATEST_FILE, checkpoints_of, keep_hf_side
from qvl.launchers.cli import main

SIDE = {"config.json": "{}", "tokenizer.json": "{}", "tensor_names.json": "[]", "unconverted.safetensors": "mtp"}


def _run_config(save: Path, pretrained: Path | None) -> SimpleNamespace:
    """The two fields of a ConfigContainer that keep_hf_side reads."""
    return SimpleNamespace(
        checkpoint=SimpleNamespace(save=str(save), pretrained_checkpoint=pretrained and str(pretrained))
    )


def _imported(root: Path) -> Path:
    """A folder as `qvl convert import` leaves it, as far as its hf/ side goes."""
    (root / HF_FILES_DIR).mkdir(parents=True)
    for name, text in SIDE.items():
        (root / HF_FILES_DIR / name).write_text(text)
    return root


def test_a_run_keeps_its_pretrained_checkpoints_hf_side_once(tmp_path):
    pretrained = _imported(tmp_path / "megatron")
    checkpoints = tmp_path / "run" / "checkpoints"
    kept = keep_hf_side(_run_config(checkpoints, pretrained))
    assert kept == checkpoints / HF_FILES_DIR
    assert {p.name: p.read_text() for p in kept.iterdir()} == SIDE  # the kept-aside tensors and names too
    (pretrained / HF_FILES_DIR / "config.json").write_text('{"changed": 1}')
    assert keep_hf_side(_run_config(checkpoints, pretrained)) == kept  # a resumed run keeps what it has
    assert (kept / "config.json").read_text() == "{}"
    assert sorted(p.name for p in checkpoints.iterdir()) == [HF_FILES_DIR]  # no staging folder left behind


def test_an_hf_checkpoint_as_pretrained_checkpoint_gives_its_side_files(tiny_qwen25_checkpoint, tmp_path):
    kept = keep_hf_side(_run_config(tmp_path / "checkpoints", tiny_qwen25_checkpoint))
    names = {p.name for p in kept.iterdir()}
    assert {"config.json", "tokenizer.json", "preprocessor_config.json", "tensor_names.json"} <= names
    assert not any(name.endswith(".safetensors") and name != "unconverted.safetensors" for name in names)


def test_a_run_without_an_hf_side_is_told_the_flag_that_gives_it(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="qvl.bridges.checkpoints"):
        assert keep_hf_side(_run_config(tmp_path / "scratch", None)) is None
        assert keep_hf_side(_run_config(tmp_path / "bare", tmp_path / "megatron-without-hf")) is None
    scratch, bare = caplog.messages
    assert "starts from scratch" in scratch and "--hf HF_DIR" in scratch
    assert "has no hf/ folder" in bare and "--hf HF_DIR" in bare
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "bare").exists()
    # only the first rank copies
    rank1 = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    for name, value in rank1.items():
        monkeypatch.setenv(name, value)
    assert keep_hf_side(_run_config(tmp_path / "rank1", _imported(tmp_path / "megatron"))) is None
    assert not (tmp_path / "rank1").exists()


def test_export_of_a_run_without_an_hf_side_names_the_flag(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (run / "checkpoints" / LATEST_FILE).write_text("2")
    assert checkpoints_of(run) == run / "checkpoints" and checkpoints_of(run / "checkpoints") == run / "checkpoints"
    assert main(["convert", "export", str(run), str(tmp_path / "out"), "--device", "cpu"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "has no hf/config.json" in line and "pass --hf HF_DIR" in line
    assert not (tmp_path / "out").exists()


def test_adapter_config_names_its_base_by_hub_id_or_absolute_path(tmp_path, monkeypatch):
    from qvl.bridges.adapter_export import base_model_name

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-VL-3B-Instruct"}))
    assert base_model_name(hf) == "Qwen/Qwen2.5-VL-3B-Instruct"
    for recorded in ("", "/somewhere/local/model"):  # no hub id: where it is
        (hf / "config.json").write_text(json.dumps({"_name_or_path": recorded}))
        monkeypatch.chdir(tmp_path)
        assert base_model_name(Path("hf")) == str(hf.resolve())
