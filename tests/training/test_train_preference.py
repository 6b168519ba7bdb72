"""Every family's preference recipes (`*_dpo`, `*_dpo_peft`) through `qvl reference` and `qvl train` on CPU.

For each family's smallest recipes on its tiny model, on pairs written in one of the four input formats and prepared
by `qvl data prepare`: the reference pass writes each side's log-probs, full-model DPO then starts at exactly log 2
(the policy is the reference), its loss falls and its reward accuracy rises, and a run resumed from its step-2
checkpoint through the Python API reproduces its losses bit for bit; DPO on adapters with the adapters switched off as
its reference trains too. For Qwen2.5-VL: both ways to the reference give the same losses, SimPO trains without one, a
killed reference pass resumes to the same table, and a reference of another checkpoint is refused in one line.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from qvl.foundation.families import FAMILIES
from qvl.training.loop import read_losses
from tests.run_qvl import gloo_threads, left_as_found, qvl_in_process, qvl_on_two_ranks
from tests.stopped_job import copy_step

STEPS = 3
# Every pair of the small sample set in each step (global_batch_size: its packs, added per family) at a learning rate
# that moves a tiny model.
OPTIONS = {
    "train_iters": STEPS,
    "micro_batch_size": 1,
    "seq_length": 256,
    "warmup_iters": 0,
    "lr": 1e-3,
    "dpo_beta": 0.5,
    "save_interval": 2,
    "log_interval": 1,
}
ARGS = [f"{name}={value}" for name, value in OPTIONS.items()]
FORMAT = {  # each input format for at least one family
    "qwen2_vl": "rlaif-v",
    "qwen2_5_vl": "trl",
    "qwen3_vl": "ms-swift",
    "qwen3_vl_moe": "llama-factory",
    "qwen3_5_vl": "llama-factory",
    "qwen3_5_vl_moe": "ms-swift",
}


def recipe(family: str, stage: str) -> str:
    """The family's smallest recipe of `stage`."""
    from qvl.recipes.registry import all_recipes

    return next(r.name for r in all_recipes() if r.family == family and r.stage == stage)


@dataclass(kw_only=True, slots=True)
class PreferenceRun:
    family: str
    hf: Path
    data: Path
    megatron: Path
    run: Path  # full-model DPO, uninterrupted
    resumed: Path  # resumed from the run's step-2 checkpoint
    adapters: Path  # DPO on adapters, the adapters switched off as the reference
    common: list[str]  # the arguments every command of the family shares


@pytest.fixture(scope="module")
def preference_run(request, tmp_path_factory) -> PreferenceRun:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.preference_samples import write_preference_samples

    family = request.param
    root = tmp_path_factory.mktemp(f"dpo-{family}")
    if family == "qwen2_5_vl":
        hf, megatron = (
            request.getfixturevalue("tiny_qwen25_checkpoint"),
            request.getfixturevalue("tiny_qwen25_megatron"),
        )
    else:
        hf, megatron = write_tiny_hf_checkpoint(root / "hf", family), root / "megatron"
        qvl_in_process("convert", "import", str(hf), str(megatron), "--dtype", "fp32", "--device", "cpu")
    jsonl, media = write_preference_samples(root / "pairs", format=FORMAT[family], count=4)
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", family, "--hf-path", str(hf)]
    qvl_in_process("data", "prepare", *prepare, "--seq-length", "256", "--output", str(root / "data"))
    packs = json.loads((root / "data" / "report.json").read_text())["packed_sequences"]
    common = [*ARGS, f"global_batch_size={packs}", f"data={root / 'data'}", f"hf_path={hf}",
              f"pretrained_checkpoint={megatron}", "--model", "tiny", "--device", "cpu"]  # fmt: skip
    full = recipe(family, "dpo")
    qvl_in_process("reference", full, *common)
    qvl_in_process("train", full, *common, "--run-dir", str(root / "full"))
    resumed = _resume_through_python(full, root / "full", root / "resumed", common)
    adapters = [recipe(family, "dpo_peft"), *common, "reference=adapters", "lr=2e-3", "adapter_rank=8"]
    qvl_in_process("train", *adapters, "--run-dir", str(root / "adapters"))
    # the same command again, from the adapter run's step-2 checkpoint (as a job stopped there leaves it)
    copy_step(root / "adapters" / "checkpoints", root / "adapters-resumed" / "checkpoints", step=2)
    qvl_in_process("train", *adapters, "--run-dir", str(root / "adapters-resumed"))
    return PreferenceRun(family=family, hf=hf, data=root / "data", megatron=megatron, run=root / "full",
                         resumed=resumed, adapters=root / "adapters", common=common)  # fmt: skip


def _resume_through_python(name: str, run: Path, resumed: Path, common: list[str]) -> Path:
    """The run as a job stopped after step 2 leaves it, resumed by the Python API: step 3."""
    from qvl.recipes.registry import get_recipe
    from qvl.training import train

    into = resumed / "checkpoints"
    copy_step(run / "checkpoints", into, step=2)
    options = dict(arg.split("=", 1) for arg in common if "=" in arg)
    config = get_recipe(name).fn(
        **OPTIONS, global_batch_size=int(options["global_batch_size"]), data=options["data"],
        hf_path=options["hf_path"], pretrained_checkpoint=options["pretrained_checkpoint"], precision="fp32",
        tensor_parallel=1, pipeline_parallel=1, expert_parallel=1, sequence_parallel=False,
        checkpoint_dir=str(into), tensorboard_dir=str(resumed / "tensorboard"),
    )  # fmt: skip
    with left_as_found():
        train(config, run_dir=resumed, device="cpu")
    return resumed


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", list(FAMILIES), indirect=True)
def test_dpo_starts_at_log_2_its_loss_falls_and_its_reward_accuracy_rises(preference_run):
    records = _records(preference_run.run)
    assert sorted(records) == list(range(1, STEPS + 1))
    first, last = records[1], records[STEPS]
    # step 1: the policy is the reference the pass computed, pair for pair, so every pair scores log sigmoid(0)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), first
    assert first["logp_chosen"] == pytest.approx(first["ref_logp_chosen"], abs=1e-4)
    assert last["loss"] < first["loss"] - 0.05, records
    assert last["reward_accuracy"] > 0.5 and last["reward_margin"] > 0, last


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", list(FAMILIES), indirect=True)
def test_a_dpo_run_resumed_from_its_step_2_checkpoint_reproduces_every_value_exactly(preference_run):
    resumed, run = _records(preference_run.resumed), _records(preference_run.run)
    assert sorted(resumed) == [3], resumed
    assert resumed == {3: run[3]}  # loss, rewards and log-probs, floats compared exactly


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", list(FAMILIES), indirect=True)
def test_dpo_on_adapters_with_the_adapters_switched_off_as_reference_trains_and_resumes_exactly(preference_run):
    records = _records(preference_run.adapters)
    assert records[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # adapters start as a zero update
    assert records[STEPS]["loss"] < records[1]["loss"], records
    resumed = _records(preference_run.adapters.with_name("adapters-resumed"))
    assert resumed == {3: records[3]}  # resumed from step 2: bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", ["qwen2_5_vl"], indirect=True)
def test_both_ways_to_the_reference_give_the_same_losses(preference_run, tmp_path):
    """The adapter recipe against the precomputed reference (the base model's log-probs) instead of adapters off."""
    args = [recipe("qwen2_5_vl", "dpo_peft"), *preference_run.common, "lr=2e-3", "adapter_rank=8"]
    qvl_in_process("train", *args, "--run-dir", str(tmp_path / "precomputed"))
    precomputed, adapters_off = read_losses(tmp_path / "precomputed"), read_losses(preference_run.adapters)
    assert precomputed == pytest.approx(adapters_off, abs=1e-6), (precomputed, adapters_off)


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", ["qwen2_5_vl"], indirect=True)
def test_simpo_trains_without_a_reference(preference_run, tmp_path):
    args = [recipe("qwen2_5_vl", "dpo"), *preference_run.common, "dpo_loss=simpo", "train_iters=2", "dpo_beta=2.0"]
    qvl_in_process("train", *args, "reference=none", "--run-dir", str(tmp_path / "simpo"))
    records = _records(tmp_path / "simpo")
    assert records[2]["loss"] < records[1]["loss"] and records[1]["ref_logp_chosen"] == 0.0, records


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", ["qwen2_5_vl"], indirect=True)
def test_a_killed_reference_pass_resumes_to_the_same_table(preference_run, tmp_path):
    """A pass stopped after two packs (its rows file as it left it) computes the rest, and the table is the same; the
    pass ends holding none of its process groups (a notebook or test process runs many)."""
    from qvl.data.reference import TABLE

    data = tmp_path / "data"
    shutil.copytree(preference_run.data, data, ignore=shutil.ignore_patterns("reference"))
    with np.load(preference_run.data / "reference" / TABLE) as table:
        whole = {key: table[key] for key in table.files}
    partial = data / "reference.partial"
    partial.mkdir()
    rows = []
    for pack in sorted(set(whole["pack"].tolist()))[:2]:
        mine = whole["pack"] == pack
        rows.append({"pack": pack, "logp": whole["logp"][mine].tolist(), "tokens": whole["tokens"][mine].tolist()})
    (partial / "rank-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"pack": 9')  # torn
    common = [a if not a.startswith("data=") else f"data={data}" for a in preference_run.common]
    threads = gloo_threads()
    log = qvl_in_process("reference", recipe("qwen2_5_vl", "dpo"), *common)
    assert gloo_threads() <= threads  # the pass let its model and process groups go (57 more threads held before)
    packs = len(set(whole["pack"].tolist()))
    assert f"{packs - 2} of this replica's {packs} packs to go (2 done before)" in log, log[-2000:]
    with np.load(data / "reference" / TABLE) as table:
        for key, value in whole.items():
            np.testing.assert_allclose(table[key], value, rtol=0, atol=1e-9)
    assert not partial.exists()


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", ["qwen2_5_vl"], indirect=True)
def test_a_reference_from_another_checkpoint_is_refused_in_one_line(preference_run, capsys):
    from qvl.launchers.cli import main

    other = preference_run.run / "checkpoints"  # the DPO run's own checkpoint: not the reference's starting model
    args = [a if not a.startswith("pretrained_checkpoint=") else f"pretrained_checkpoint={other}"
            for a in preference_run.common]  # fmt: skip
    with left_as_found():
        code = main(["train", recipe("qwen2_5_vl", "dpo"), *args, "--run-dir", str(preference_run.run.parent / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"pretrained_checkpoint={other.resolve()}" in err[0] and "qvl reference" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("preference_run", ["qwen3_vl_moe"], indirect=True)
def test_dpo_at_tensor_parallel_2_gives_the_single_process_reference_and_losses(preference_run, tmp_path):
    """The reference pass and full-model DPO of an MoE model on two gloo processes at TP=2, with the sequence
    parallelism it needs there: each pack padded to an even length (a pad sub-sequence after the pairs, which the
    pair layout and the routers leave out), the deepstack features' gradient summed over the ranks. The reference
    table and the losses are one process's within fp32 rounding."""
    from qvl.data.reference import TABLE

    data = tmp_path / "data"
    shutil.copytree(preference_run.data, data, ignore=shutil.ignore_patterns("reference"))
    common = [a if not a.startswith("data=") else f"data={data}" for a in preference_run.common]
    name = recipe(preference_run.family, "dpo")
    qvl_on_two_ranks("reference", name, *common, "tensor_parallel=2")
    with np.load(preference_run.data / "reference" / TABLE) as one, np.load(data / "reference" / TABLE) as two:
        assert sorted(one.files) == sorted(two.files)
        for key in one.files:
            np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-5)
    qvl_on_two_ranks("train", name, *common, "tensor_parallel=2", "--run-dir", str(tmp_path / "run"))
    one, two = read_losses(preference_run.run), read_losses(tmp_path / "run")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), (one, two)
