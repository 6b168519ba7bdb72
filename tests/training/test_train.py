"""`qvl train` runs Megatron-Bridge's own training loop on a tiny Qwen2.5-VL over a packed qvl dataset on
CPU: the loss falls, a checkpoint is written, a run stopped mid-way and resumed reproduces the
uninterrupted loss curve exactly, and the trained checkpoint exports to HF that transformers loads."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qvl.training.loop import read_losses
from tests.run_qvl import gloo_threads, left_as_found, qvl_forked, qvl_in_process, qvl_on_two_ranks

STEPS = 6
ARGS = [
    "qwen2_5_vl_3b_pretrain",
    f"train_iters={STEPS}",
    "global_batch_size=2",
    "micro_batch_size=1",
    "seq_length=256",
    "warmup_iters=1",
    "lr=1e-3",
    "save_interval=100",
    "log_interval=1",
]


@pytest.fixture(scope="module")
def dataset(tiny_dataset, tiny_qwen25_checkpoint) -> tuple[Path, Path]:
    """The session's prepared sample set (seq_length 256) and the tiny Qwen2.5-VL it was prepared for."""
    return tiny_dataset, tiny_qwen25_checkpoint


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:
    data, hf = dataset
    root = tmp_path_factory.mktemp("runs")
    common = [*ARGS, f"data={data}", f"hf_path={hf}", "--model", "tiny", "--device", "cpu"]
    qvl_in_process("train", *common, "--run-dir", str(root / "full"))
    # The stopped and resumed run also recomputes the HF vision tower's first block (the later ones keep their
    # activations): that must not change a single loss either.
    resumed = [*common, "vision_recompute=true", "vision_recompute_blocks=1"]
    done = qvl_forked("train", *resumed, "--run-dir", str(root / "resumed"), "--stop-after", "3")
    assert done.returncode == 0, done.stderr[-4000:]
    stopped = done.stdout + done.stderr
    # A planned stop reads as one: no "Pretrain failed ... SystemExit: 0" and no traceback.
    assert "Pretrain failed" not in stopped and "Traceback" not in stopped, stopped[-4000:]
    assert "trained 3 steps" in stopped
    assert "vision recompute on in 1 HF vision tower(s), 1 blocks in all" in stopped, stopped[-4000:]
    qvl_in_process("train", *resumed, "--run-dir", str(root / "resumed"))  # same command again: resumes from step 3
    return {"full": root / "full", "resumed": root / "resumed"}


@pytest.mark.slow
def test_loss_falls_and_a_checkpoint_is_saved(runs):
    losses = read_losses(runs["full"])
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.3, losses
    assert (runs["full"] / "checkpoints" / f"iter_{STEPS:07d}").is_dir()


@pytest.mark.slow
def test_stopped_and_resumed_run_reproduces_the_loss_curve_exactly(runs):
    full, resumed = read_losses(runs["full"]), read_losses(runs["resumed"])
    assert (runs["resumed"] / "checkpoints" / "iter_0000003").is_dir()
    log = (runs["resumed"] / "losses.jsonl").read_text().splitlines()
    assert len(log) == STEPS, "the second run must continue at step 4, not start again"
    assert resumed == full  # bit-identical floats: data position, weights and Adam state all restored


@pytest.mark.slow
def test_trained_checkpoint_exports_to_hf_that_transformers_loads(runs, dataset, tmp_path):
    from transformers import AutoModelForImageTextToText

    _, hf = dataset
    # a run from scratch keeps no HF side: --hf gives it; the export is checked against the trained model
    out = qvl_in_process(
        "convert", "export", str(runs["full"]), str(tmp_path / "export"), "--hf", str(hf), "--device", "cpu"
    )
    assert "checked against the trained model" in out and "\nOK\n" in out, out[-2000:]
    trained = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(str(hf), dtype=torch.float32).state_dict()
    assert trained.keys() == initial.keys()
    changed = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert len(changed) > len(trained) // 2, "training must have moved most weights"


def test_dotted_overrides_set_config_fields_and_unknown_ones_are_named(tmp_path, cpu_runtime):
    from qvl.foundation.errors import ConfigError
    from qvl.training.loop import TrainRequest, prepare_config

    request = TrainRequest(
        recipe="qwen2_5_vl_3b_pretrain",
        overrides={"train.exit_interval": 7, "train_iters": 3},
        run_dir=tmp_path,
        model="tiny",
        device="cpu",
    )
    _, config = prepare_config(request)
    assert (config.train.exit_interval, config.train.train_iters) == (7, 3)
    assert config.model.vocab_size == 512 and config.model.tensor_model_parallel_size == 1  # the tiny model, alone
    request.overrides = {"train.nope": 1}
    with pytest.raises(ConfigError, match=r"train \(TrainingConfig\) has no field 'nope'"):
        prepare_config(request)


@pytest.mark.slow
def test_pipeline_parallel_2_trains_the_packed_dataset_like_one_stage(dataset, tiny_qwen25_megatron, tmp_path):
    """PP=2 (two gloo processes) from the same converted checkpoint gives PP=1's losses: packed batches are padded
    to seq_length for the fixed-shape stage-to-stage buffers."""
    data, hf = dataset
    common = [
        "qwen2_5_vl_3b_sft",
        f"data={data}",
        f"hf_path={hf}",
        f"pretrained_checkpoint={tiny_qwen25_megatron}",
        *ARGS[1:],
        "train_iters=2",
        "--model",
        "tiny",
        "--device",
        "cpu",
    ]
    qvl_in_process("train", *common, "--run-dir", str(tmp_path / "pp1"))
    qvl_on_two_ranks("train", *common, "pipeline_parallel=2", "--run-dir", str(tmp_path / "pp2"))
    one, two = read_losses(tmp_path / "pp1"), read_losses(tmp_path / "pp2")
    assert sorted(two) == [1, 2]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5)


def test_a_training_loop_starts_without_the_moe_metrics_of_an_earlier_run(monkeypatch):
    """Megatron-Core's MoE metrics tracker sizes its per-layer entries by the first MoE model of the process; a
    later run with more layers (or MTP layers) would index past them, so each loop starts without one. Nor with the
    0-d auxiliary-loss scale an MoE backward outside a loop leaves (the loop's 1-element scale would not copy into
    it)."""
    from qvl.foundation import megatron

    megatron.import_megatron_bridge()
    from megatron.bridge.training import pretrain as pretrain_module
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from qvl.training.loop import run_megatron_loop

    earlier = moe_logging.get_moe_metrics_tracker()
    earlier.record("load_balancing_loss", torch.tensor(1.0), layer_number=1, num_layers=4)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))  # as a backward leaves it
    seen = []

    def pretrain(*args, **kwargs):
        seen.append(moe_logging.get_moe_metrics_tracker())
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # what Megatron-Bridge's initialisation does first

    monkeypatch.setattr(pretrain_module, "pretrain", pretrain)
    run_megatron_loop(SimpleNamespace(model=SimpleNamespace(), peft=None), forward_step=None, callbacks=None)
    assert seen and seen[0] is not earlier and not seen[0].metrics
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.shape == (1,)


@pytest.mark.slow
def test_a_finished_loop_releases_its_model_and_process_groups(dataset, tiny_qwen25_megatron, tmp_path):
    """A notebook (or a test process) runs loop after loop: each one's model, optimizer and process groups must go
    when it ends, not pile up (Megatron-Core's DDP hooks make a cycle the collector cannot see; with PEFT, the config
    is in a cycle through Megatron-Bridge's pre-wrap hook and its provider names the groups)."""
    data, hf = dataset
    common = [*ARGS[1:], "train_iters=1", f"data={data}", f"hf_path={hf}", "--model", "tiny", "--device", "cpu"]
    adapters = ["qwen2_5_vl_3b_peft", f"pretrained_checkpoint={tiny_qwen25_megatron}"]
    from qvl.launchers.cli import main

    def train(run: str, *recipe: str) -> None:
        with left_as_found(forget_groups=False):  # what the loop itself releases, no help from the test harness
            assert main(["train", *recipe, *common, "--run-dir", str(tmp_path / run)]) == 0

    before, frozen = gloo_threads(), gc.get_freeze_count()
    for run, recipe in (("first", ARGS[:1]), ("adapters", adapters), ("third", ARGS[:1])):
        train(run, *recipe)
        assert gloo_threads() == before, f"the {run} run left its process groups' threads running"
        # and the import-time objects stay frozen (foundation.megatron.gc_paused; some die, by reference count): a loop
        # that unfroze them (Energon's loader does by default) makes every later full collection walk them again
        assert gc.get_freeze_count() > frozen * 0.9 > 0, f"the {run} run unfroze the import-time objects"
