"""The parity check sees weight decay (qvl.training.parity.decay) and refuses step counts that cannot show what it
claims: each framework's decay is read per tensor from the optimizer it built and compared by HF name, so a reference
that decays nothing against qvl's recipe fails even at `--steps 1` (before, it passed on weights at 3 steps and went
unseen at 2); and a multi-step check with one optimizer update is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from qvl.foundation.errors import ConfigError
from qvl.training.parity.run import ParitySpec, check_updates

OPTIONS = {"seq_length": 200, "lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.1}


@pytest.mark.parametrize(
    ("steps", "warmup", "refused"), [(1, None, False), (2, None, True), (2, 0, False), (3, None, False), (3, 2, False)]
)
def test_a_check_with_one_update_over_several_steps_is_refused(steps, warmup, refused):
    options = {} if warmup is None else {"warmup_iters": warmup}
    spec = ParitySpec(hf_path=Path("hf"), data=Path("data"), run_dir=Path("run"), steps=steps, options=options)
    if not refused:
        check_updates(spec)
        return
    with pytest.raises(ConfigError, match=r"makes 1 optimizer update .* lr x sign\(gradient\)"):
        check_updates(spec)


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity-decay")
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen2_5_vl")
    return hf, prepare_parity_dataset(hf, "qwen2_5_vl", root, seq_length=OPTIONS["seq_length"])


def _run(qwen25, tmp_path, **spec):
    from qvl.training.parity.run import run_parity

    hf, data = qwen25
    return run_parity(ParitySpec(hf_path=hf, data=data, run_dir=tmp_path, steps=1, options=OPTIONS, **spec))


@pytest.mark.slow
def test_decay_groups_come_from_both_optimizers_and_a_reference_that_decays_nothing_fails(
    qwen25, tmp_path, monkeypatch
):
    from qvl.training.parity import transformers_run

    report = _run(qwen25, tmp_path / "same")
    assert report.ok, report.failures  # the recipe's groups, read from Megatron's optimizer, are the reference's
    monkeypatch.setattr(transformers_run, "megatron_no_decay", lambda name, param: True)  # decays nothing
    report = _run(qwen25, tmp_path / "none")
    (failure,) = [f for f in report.failures if f.startswith("weight decay differs")]
    assert "differs on 53 tensors" in failure and "lm_head.weight (0.1 vs 0)" in failure, failure  # every matrix
    # the other difference the check names: transformers' own rule decays Qwen2.5-VL's vision RMSNorm weights
    report = _run(qwen25, tmp_path / "trainer", weight_decay_rule="transformers")
    (failure,) = [f for f in report.failures if f.startswith("weight decay differs")]
    assert "visual.blocks.0.norm1.weight (0 vs 0.1)" in failure, failure
