"""`qvl train` of a Qwen3.5-family SFT recipe as users run it in 2026: a (tiny) Qwen3.8 checkpoint with its
multi-token-prediction head imported, reasoning-trace data rendered by its template (`reasoning_effort=low`), MTP
trained by default (scale 0.1) beside the LM on packed data on CPU. Both losses are logged and fall, a run stopped
after step 3 and resumed reproduces both bit for bit, the exported `mtp.*` tensors have moved; with `mtp=false` they
export unchanged. A checkpoint without `mtp.*` is refused with the option that fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qvl.training.loop import read_losses
from tests.bridges.test_qwen3_5_vl import tensors
from tests.run_qvl import qvl_in_process
from tests.training.test_train import ARGS as TRAIN_ARGS
from tests.training.test_train import STEPS

FAMILY = "qwen3_5_vl"
ARGS = ["qwen3_8_vl_27b_sft", *TRAIN_ARGS[1:]]  # test_train's settings, on a Qwen3.8 SFT recipe (MTP on)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from qvl.bridges.convert import copy_hf_side_files
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset

    root = tmp_path_factory.mktemp("train_mtp")
    jsonl, media = write_sample_dataset(root / "samples", reasoning=True)
    hf = write_tiny_hf_checkpoint(root / "hf", FAMILY, release="3.8")
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", FAMILY, "--hf-path", str(hf)]
    prepare += ["--template-arg", "reasoning_effort=low", "--seq-length", "256", "--output", str(root / "data")]
    qvl_in_process("data", "prepare", *prepare)
    qvl_in_process("convert", "import", str(hf), str(root / "megatron"), "--dtype", "fp32", "--device", "cpu")
    common = [*ARGS, f"data={root / 'data'}", f"hf_path={hf}", f"pretrained_checkpoint={root / 'megatron'}"]
    common += ["--model", "tiny", "--device", "cpu"]
    qvl_in_process("train", *common, "--run-dir", str(root / "full"))
    stopped = qvl_in_process("train", *common, "--run-dir", str(root / "resumed"), "--stop-after", "3")
    assert "trained 3 steps" in stopped and "Traceback" not in stopped, stopped[-4000:]
    qvl_in_process("train", *common, "--run-dir", str(root / "resumed"))  # the same command again resumes from 3
    qvl_in_process("train", *common, "mtp=false", "train_iters=2", "--run-dir", str(root / "no_mtp"))
    for run in ("full", "no_mtp"):  # with the converted checkpoint's hf/ folder: config, names, kept-aside mtp.*
        copy_hf_side_files(root / "megatron" / "hf", root / run / "checkpoints" / "hf")
        qvl_in_process(
            "convert", "export", str(root / run / "checkpoints"), str(root / run / "export"), "--device", "cpu"
        )
    return {"hf": hf, **{run: root / run for run in ("full", "resumed", "no_mtp")}}


@pytest.mark.slow
def test_lm_and_mtp_losses_are_logged_and_fall(runs):
    losses, mtp_losses = read_losses(runs["full"]), read_losses(runs["full"], "mtp_loss")
    assert sorted(losses) == sorted(mtp_losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.3 and mtp_losses[STEPS] < mtp_losses[1] - 0.2, (losses, mtp_losses)


@pytest.mark.slow
def test_stopped_and_resumed_run_reproduces_both_losses_exactly(runs):
    for key in ("loss", "mtp_loss"):
        assert read_losses(runs["resumed"], key) == read_losses(runs["full"], key)  # floats compared exactly


@pytest.mark.slow
def test_the_trained_mtp_head_exports_changed(runs):
    original, exported = tensors(runs["hf"]), tensors(runs["full"] / "export")
    assert sorted(exported) == sorted(original)
    mtp = [name for name in original if name.startswith("mtp.")]
    assert mtp and [n for n in mtp if torch.equal(original[n], exported[n])] == []  # every MTP tensor trained


@pytest.mark.slow
def test_without_mtp_the_head_exports_unchanged(runs):
    original, exported = tensors(runs["hf"]), tensors(runs["no_mtp"] / "export")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(original[n], exported[n]) for n in original if n.startswith("mtp."))
    assert read_losses(runs["no_mtp"], "mtp_loss") == {}


def test_mtp_on_for_a_checkpoint_without_an_mtp_head_names_the_fix(tmp_path, cpu_runtime):
    from safetensors.torch import load_file, save_file

    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation.errors import ConfigError
    from qvl.training.loop import TrainRequest, prepare_config

    hf = write_tiny_hf_checkpoint(tmp_path / "hf", FAMILY)
    weights = load_file(str(hf / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(hf / "model.safetensors"))
    request = TrainRequest(recipe="qwen3_5_vl_9b_sft", overrides={"hf_path": str(hf)}, run_dir=tmp_path, device="cpu")
    with pytest.raises(ConfigError, match=r"holds 0 MTP layer.*train with mtp=false"):
        prepare_config(request)
    off = {"hf_path": str(hf), "mtp": False, "tensor_parallel": 1}
    off = TrainRequest(recipe="qwen3_5_vl_9b_sft", overrides=off, run_dir=tmp_path)
    assert prepare_config(off)[1].model.mtp_num_layers is None
