"""`qvl train` on a tiny Qwen3.5-VL (hybrid Gated DeltaNet + gated attention LM, torch DeltaNet kernels, no TE or
fla) over a packed qvl dataset on CPU: Megatron-Bridge's own loop lowers the loss, and a run stopped after step 3
and resumed reproduces the uninterrupted run's losses bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from qvl.training.loop import read_losses
from tests.run_qvl import qvl_in_process
from tests.training.test_train import ARGS as TRAIN_ARGS
from tests.training.test_train import STEPS

FAMILY = "qwen3_5_vl"
ARGS = ["qwen3_5_vl_9b_pretrain", *TRAIN_ARGS[1:]]  # test_train's settings, on this family's recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset

    root = tmp_path_factory.mktemp("train_qwen3_5")
    jsonl, media = write_sample_dataset(root / "samples")
    hf = write_tiny_hf_checkpoint(root / "hf", FAMILY)
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", FAMILY, "--hf-path", str(hf)]
    qvl_in_process("data", "prepare", *prepare, "--seq-length", "256", "--output", str(root / "data"))
    common = [*ARGS, f"data={root / 'data'}", f"hf_path={hf}", "--model", "tiny", "--device", "cpu"]
    qvl_in_process("train", *common, "--run-dir", str(root / "full"))
    stopped = qvl_in_process("train", *common, "--run-dir", str(root / "resumed"), "--stop-after", "3")
    assert "trained 3 steps" in stopped and "Traceback" not in stopped, stopped[-4000:]
    qvl_in_process("train", *common, "--run-dir", str(root / "resumed"))  # the same command again resumes from 3
    return {"full": root / "full", "resumed": root / "resumed"}


@pytest.mark.slow
def test_loss_falls(runs):
    losses = read_losses(runs["full"])
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.3, losses


@pytest.mark.slow
def test_stopped_and_resumed_run_reproduces_the_losses_exactly(runs):
    full, resumed = read_losses(runs["full"]), read_losses(runs["resumed"])
    assert resumed == full  # every step, bit for bit (floats compared exactly)
