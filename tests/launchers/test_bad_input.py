"""Bad input at the seams: every wrong value ends in one `error:` line naming the value and the fix,
exit status 2, no traceback; nothing is dropped silently. Real recipes throughout (no stand-ins)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from qvl.foundation.errors import ConfigError, ConversionError, LaunchError
from qvl.foundation.layout import ModelFacts, ParallelLayout, check_layout
from qvl.launchers.cli import main
from qvl.launchers.jobs import launch, resolve_job
from qvl.recipes.overrides import parse_value
from qvl.recipes.registry import STAGES

RECIPE = "qwen2_5_vl_7b_sft"  # 28 attention heads, 4 KV heads, 28 layers
SLURM = [
    "run.executor.account=acct",
    "run.executor.partition=batch",
    "run.executor.container_image=nvcr.io/nvidia/nemo:25.09",
    "run.executor.host=login.example.com",
    "run.executor.job_dir=/lustre/qvl",
]


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch):
    """NeMo-Run's Slurm packaging reads stdin through invoke; pytest's stdin refuses reads."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())


def one_error_line(capsys, argv: list[str]) -> str:
    """Run `qvl ARGV`; assert exit 2, one `error:` line on stderr and no traceback; return that line."""
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# ---- 1: a misspelt key is refused with a did-you-mean, dry run or not, against the real recipe ----


def test_misspelt_recipe_key_is_refused_on_the_real_recipe_dry_run_or_not(capsys, tmp_path):
    argv = ["launch", RECIPE, "--executor", "slurm", "tensorparalel=2", *SLURM, "--experiments-dir", str(tmp_path)]
    line = one_error_line(capsys, [*argv, "--dryrun"])
    assert "'tensorparalel' is not a recipe option; did you mean tensor_parallel" in line
    assert one_error_line(capsys, argv) == line  # without --dryrun: refused before anything is submitted
    assert not list(tmp_path.rglob("*.sh"))


def test_misspelt_config_field_is_refused_before_submission(tmp_path):
    with pytest.raises(
        ConfigError, match=r"train \(TrainingConfig\) has no field 'train_iterz'; did you mean train_iters"
    ):
        launch(RECIPE, ["train.train_iterz=5", *SLURM], kind="slurm", experiments_dir=str(tmp_path))


# ---- 2: one grammar on both sides; the dry run's config is the job's ----


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-4", 1e-4), ("4", 4), ("none", None), ("null", None), ("true", True), ("[a, b]", ["a", "b"]),
     ("[1e-4, 2]", [1e-4, 2]), ("04:00:00", "04:00:00"), ("'4'", "4"), ("vision,projector", "vision,projector")],
)  # fmt: skip
def test_one_value_grammar(text, value):
    assert parse_value(text) == value


def test_dryrun_prints_the_config_the_job_builds(tmp_path):
    from qvl.launchers.site import to_plain
    from qvl.recipes.overrides import parse_overrides
    from qvl.training.loop import TrainRequest, prepare_config

    pairs = ["lr=1e-4", "freeze=none", "train.train_iters=7"]
    result = launch(RECIPE, [*pairs, *SLURM], kind="slurm", dryrun=True, resolve=True, experiments_dir=str(tmp_path))
    printed = result["config"]["config"]
    assert printed["optimizer"]["lr"] == 1e-4 and printed["train"]["train_iters"] == 7
    # The execution side runs `qvl train RECIPE <the same texts>`, parsed by the same grammar.
    job = resolve_job(RECIPE, pairs)
    reparsed = parse_overrides(job.argv[2:]).as_dict()
    assert reparsed == {"lr": 1e-4, "freeze": (), "train.train_iters": 7}  # freeze=none: nothing frozen
    # On Slurm without --run-dir the job writes to its job folder's run/, beside code/ where it runs.
    assert job.argv[-2:] != ["--run-dir", "../run"] and result["config"]["command"].endswith(" --run-dir ../run")
    request = TrainRequest(recipe=RECIPE, overrides=reparsed, run_dir=Path("../run"))
    _, config = prepare_config(request, cpu=False)
    assert to_plain(config, depth=2) == printed


# ---- 3: the layout check names the model constraint and values that fit both the model and the world ----


def test_tensor_parallel_that_does_not_divide_the_heads_names_them(capsys, tmp_path):
    line = one_error_line(capsys, ["launch", RECIPE, "--executor", "slurm", "--dryrun", "tensor_parallel=3", *SLURM])
    assert "tensor_parallel=3 does not divide Qwen2.5-VL 7B's 28 attention heads" in line
    assert "4 KV heads" in line and "use tensor_parallel=1, 2 or 4" in line
    assert "nodes=" not in line


@pytest.mark.parametrize(
    ("layout", "world", "message"),
    [
        (dict(tensor_parallel=8), None, r"tensor_parallel=8 does not divide m's 12 attention heads .*; use tensor_parallel=1 or 2$"),
        (dict(tensor_parallel=4), None, r"tensor_parallel=4 does not divide m's 2 KV heads"),
        (dict(expert_parallel=2), None, r"expert_parallel=2 needs a mixture-of-experts model"),
        (dict(pipeline_parallel=5), None, r"5 stages for .* 4 layers; use pipeline_parallel=1, 2, 3 or 4"),
        (dict(tensor_parallel=2), 6, r"world size 6 is not divisible by tensor_parallel=2 x pipeline_parallel=4 = 8"),
    ],
)  # fmt: skip
def test_layout_check_names_the_failing_constraint(layout, world, message):
    model = ModelFacts(attention_heads=12, kv_heads=2, layers=4, name="m")
    if world:
        layout = layout | {"pipeline_parallel": 4}
    with pytest.raises(ConfigError, match=message):
        check_layout(model, ParallelLayout(**layout), world_size=world)


def test_moe_and_vision_heads_are_checked():
    moe = ModelFacts(attention_heads=32, kv_heads=4, layers=48, experts=128, vision_heads=16, name="moe")
    with pytest.raises(
        ConfigError, match=r"expert_parallel=3 does not divide moe's 128 experts; use expert_parallel=1, 2, 4"
    ):
        check_layout(moe, ParallelLayout(expert_parallel=3))
    vision = ModelFacts(attention_heads=32, kv_heads=32, layers=4, vision_heads=12, name="v")
    with pytest.raises(
        ConfigError, match=r"does not divide v's 12 vision attention heads .*; use tensor_parallel=1, 2 or 4"
    ):
        check_layout(vision, ParallelLayout(tensor_parallel=8))


# ---- 6: output that fits pipes ----


def test_qvl_recipes_into_a_pipe_keeps_whole_names_in_natural_size_order():
    out = subprocess.run(
        [sys.executable, "-m", "qvl.launchers.cli", "recipes", "--family", "qwen2_5_vl"],
        capture_output=True, text=True, check=True, env={"COLUMNS": "80", "PATH": ""},
    ).stdout  # fmt: skip
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert "…" not in out and "qwen2_5_vl_32b_sft" in names
    per_size = len(STAGES)  # a recipe per stage, sizes in natural order
    assert [n.removeprefix("qwen2_5_vl_").split("_")[0] for n in names[::per_size]] == ["3b", "7b", "32b", "72b"]


def test_qvl_recipes_and_plan_json(capsys):
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"recipe", "size", "TP", "planned GPUs"} <= set(rows[0]) and len(rows) > 30
    assert main(["plan", RECIPE, "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["layout"]["tensor_parallel"] == 2 and plan["stages"][0]["total_gib"] > 0


# ---- 8: dry runs need no cluster credentials ----


def test_kubernetes_dryrun_needs_no_kubeconfig(tmp_path, monkeypatch):
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    settings = ["run.executor.image=img", "run.executor.nodes=1", "run.executor.workdir_pvc=qvl-work"]
    result = launch(RECIPE, settings, kind="kubernetes", dryrun=True, experiments_dir=str(tmp_path))
    assert "kind: TrainJob" in result["request"]
    with pytest.raises(LaunchError, match=r"needs a kubeconfig .* `--dryrun` prints the TrainJob without one"):
        launch(RECIPE, settings, kind="kubernetes", experiments_dir=str(tmp_path))


# ---- 9, 10: training refuses what would fail after the model is built; a planned stop is not a failure ----


def test_fine_tune_without_pretrained_checkpoint_is_refused(capsys, tmp_path):
    line = one_error_line(capsys, ["train", "qwen2_5_vl_3b_sft", "--model", "tiny", "--run-dir", str(tmp_path)])
    assert "pretrained_checkpoint is not set; pass pretrained_checkpoint=DIR" in line and "qvl convert import" in line


def test_context_parallelism_without_te_is_refused_before_a_model_is_built(capsys, tmp_path):
    from qvl.foundation.megatron import have_transformer_engine

    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed: its attention runs context parallelism")
    line = one_error_line(capsys, ["train", "qwen2_5_vl_3b_sft", "--model", "tiny", "context_parallel=2", "--run-dir",
                                   str(tmp_path)])  # fmt: skip
    assert "context_parallel=2 needs Transformer Engine" in line and "or set context_parallel=1" in line


def test_stop_after_is_not_logged_as_a_failure():
    from qvl.training.loop import _CleanExitFilter

    def record(error: BaseException) -> logging.LogRecord:
        return logging.LogRecord("megatron.bridge.training.pretrain", logging.ERROR, "", 0, "Pretrain failed", (),
                                 (type(error), error, None))  # fmt: skip

    assert not _CleanExitFilter().filter(record(SystemExit(0)))
    assert _CleanExitFilter().filter(record(SystemExit(1))) and _CleanExitFilter().filter(record(RuntimeError()))


# ---- the rest of the classes: site files, sizes, paths, output dirs, checkpoints ----


def test_malformed_site_file(capsys, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("slurm:\n  account: acct\n\tpartition: batch\n")
    line = one_error_line(capsys, ["launch", RECIPE, "--executor", "slurm", "--dryrun", "--executor-config", str(site)])
    assert f"--executor-config {site}: not valid YAML at line 3" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", RECIPE, "global_batch_size=abc"], "global_batch_size='abc' must be an integer (e.g. global_batch_size=128)"),
        (["plan", RECIPE, "tensor_parallel=0"], "tensor_parallel=0 must be at least 1"),
        (["plan", RECIPE, "micro_batch_size=-1"], "micro_batch_size=-1 must be at least 1"),
        (["plan", RECIPE, "lr=fast"], "lr='fast' must be a number"),
        (["plan", RECIPE, "--gpus", "0"], "--gpus 0 must be at least 1"),
        (["plan", "qwen2_5_vl_7b_stf"], "no recipe named 'qwen2_5_vl_7b_stf'; did you mean qwen2_5_vl_7b_sft"),
        (["plan", RECIPE, "tensor_parallel"], "override 'tensor_parallel' is not key=value"),
        (["launch", RECIPE, "--dryrun", "run.executor.nodez=2", *SLURM, "--executor", "slurm"], "has no setting nodez"),
    ],
)  # fmt: skip
def test_bad_sizes_and_names(capsys, argv, message):
    assert message in one_error_line(capsys, argv)


def test_missing_dataset_and_unwritable_run_dir(capsys, tmp_path):
    line = one_error_line(
        capsys, ["train", "qwen2_5_vl_3b_pretrain", "--model", "tiny", f"data={tmp_path / 'nope'}", "--run-dir",
                 str(tmp_path / "run")],
    )  # fmt: skip
    assert f"data={tmp_path / 'nope'} does not exist" in line
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_error_line(capsys, ["train", "qwen2_5_vl_3b_pretrain", "--run-dir", str(blocker / "run")])
    assert f"--run-dir={blocker / 'run'} cannot be written" in line


def test_truncated_megatron_checkpoint_is_refused(capsys, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from qvl.bridges.checkpoints import check_megatron_checkpoint

    ckpt = tmp_path / "ckpt"
    dcp.save({"weight": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(ckpt / "iter_0000001"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    assert check_megatron_checkpoint(ckpt).name == "iter_0000001"
    (shard,) = (ckpt / "iter_0000001").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConversionError, match=r"__0_0.distcp is truncated \(1000 of \d+ bytes\)"):
        check_megatron_checkpoint(ckpt, "pretrained_checkpoint")
    line = one_error_line(
        capsys, ["train", "qwen2_5_vl_3b_sft", "--model", "tiny", f"pretrained_checkpoint={ckpt}", "--run-dir",
                 str(tmp_path / "run")],
    )  # fmt: skip
    assert "is truncated" in line and "copy or write the checkpoint again" in line
    with pytest.raises(ConversionError, match=r"not a Megatron checkpoint \(no latest_checkpointed_iteration.txt\)"):
        check_megatron_checkpoint(tmp_path)
