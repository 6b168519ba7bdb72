"""`qvl train` of a Qwen3.5-family SFT recipe as users run it in 2026: a (tiny) Qwen3.8 checkpoint with its
multi-token-prediction head imported, reasoning-trace data rendered by its template (`reasoning_effort=low`), MTP
trained by default (scale 0.1) beside the LM on packed data on CPU. Both losses are logged and fall, a run stopped
after step 3 and resumed reproduces both bit for bit, the exported `mtp.*` tensors have moved; with `mtp=false` they
export unchanged. A checkpoint without `mtp.*` (as transformers saves it) trains without options and builds no MTP
layer; `mtp=true` on it is refused with the option that fixes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qvl.training.loop import read_losses
from tests.bridges.test_qwen3_5_vl import tensors, without_mtp_head
from tests.run_qvl import qvl_in_process
from tests.training.test_train import ARGS as TRAIN_ARGS
from tests.training.test_train import STEPS

FAMILY = "qwen3_5_vl"
ARGS = ["qwen3_8_vl_27b_sft", *TRAIN_ARGS[1:]]  # test_train's settings, on a Qwen3.8 SFT recipe (MTP on)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
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
    # the same recipe, no MTP option, from a checkpoint saved without its head
    headless = without_mtp_head(write_tiny_hf_checkpoint(root / "hf_headless", FAMILY, release="3.8"))
    qvl_in_process(
        "convert", "import", str(headless), str(root / "megatron_headless"), "--dtype", "fp32", "--device", "cpu"
    )
    no_head = [
        *ARGS,
        f"data={root / 'data'}",
        f"hf_path={headless}",
        f"pretrained_checkpoint={root / 'megatron_headless'}",
    ]
    headless_output = qvl_in_process(
        "train", *no_head, "train_iters=2", "--model", "tiny", "--device", "cpu", "--run-dir", str(root / "headless")
    )
    for run in ("full", "no_mtp"):  # nothing copied: the run kept the import's hf/ (config, names, kept-aside mtp.*)
        qvl_in_process("convert", "export", str(root / run), str(root / run / "export"), "--device", "cpu")
    runs = {run: root / run for run in ("full", "resumed", "no_mtp", "headless")}
    return {"hf": hf, "headless_output": headless_output, **runs}


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


@pytest.mark.slow
def test_a_checkpoint_without_an_mtp_head_trains_without_options(runs):
    assert sorted(read_losses(runs["headless"])) == [1, 2] and read_losses(runs["headless"], "mtp_loss") == {}
    assert "has no MTP head; training without" in runs["headless_output"]
