"""`qvl launch`: golden sbatch script and TrainJob manifest, every pre-submission check, and a real local CPU run.

Golden files live in tests/launchers/golden/; `QVL_UPDATE_GOLDEN=1 pytest tests/launchers/test_launch.py` rewrites
them. Nothing here contacts a cluster: Slurm dry runs use an SSH tunnel that is never opened, the Kubernetes
dry run a kubeconfig pointing nowhere.
"""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from qvl.foundation.errors import LaunchError, QvlError
from qvl.launchers import cli
from qvl.launchers.jobs import launch, resolve_job
from qvl.launchers.site import load_site_config
from qvl.recipes import registry
from tests.launchers.crd_schema import TRAINER_RELEASES, trainjob_errors
from tests.launchers.test_executors import fake_kubeconfig  # noqa: F401  (fixture)

GOLDEN = Path(__file__).parent / "golden"
FAKE_RECIPE = "qvl_test_tiny_sft"
IMAGE = "nvcr.io/nvidia/nemo:25.09"
SLURM = [
    f"run.executor.{kv}"
    for kv in (
        "account=acct",
        "partition=batch",
        f"container_image={IMAGE}",
        "host=login.example.com",
        "user=qvl",
        "job_dir=/lustre/qvl/experiments",
    )
]


@dataclass
class TrainSection:
    train_iters: int = 10
    micro_batch_size: int = 1


@dataclass
class TinyConfig:
    train: TrainSection = field(default_factory=TrainSection)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1


def tiny_sft(*, tensor_parallel: int = 2, pipeline_parallel: int = 1, **overrides) -> TinyConfig:
    """A stand-in recipe: a tiny config whose layout comes from its keywords (options like the real ones')."""
    return TinyConfig(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)


def needs_checkpoint(*, hf_path: str, **overrides) -> TinyConfig:
    """A stand-in recipe whose checkpoint exists only on the cluster."""
    raise FileNotFoundError(hf_path)


@pytest.fixture(autouse=True)
def empty_stdin(monkeypatch):
    """NeMo-Run's Slurm packaging runs `mkdir` through invoke, which reads stdin; pytest's stdin refuses reads."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())


@pytest.fixture
def fake_recipe(monkeypatch):
    """Register the stand-in recipes for one test (the real ones are written in recipes/ concurrently)."""
    monkeypatch.setattr(registry, "RECIPE_MODULES", ())  # only the stand-ins: no dependence on recipes/ modules
    registry.recipe(family="qvl_test", size="tiny", stage="sft", name=FAKE_RECIPE, tensor_parallel=2, gpus=8)(tiny_sft)
    registry.recipe(family="qvl_test", size="tiny", stage="sft", name="qvl_test_ckpt_sft")(needs_checkpoint)
    yield FAKE_RECIPE
    registry._RECIPES.pop(FAKE_RECIPE, None)
    registry._RECIPES.pop("qvl_test_ckpt_sft", None)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("QVL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with QVL_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), f"{name} differs from the golden file; QVL_UPDATE_GOLDEN=1 rewrites it"


def test_slurm_sbatch_matches_golden(fake_recipe, tmp_path):
    result = launch(
        fake_recipe,
        [
            "tensor_parallel=4",
            "train.train_iters=5",
            "run.executor.nodes=2",
            "run.executor.mounts=[/lustre/data:/data]",
            *SLURM,
        ],
        kind="slurm",
        dryrun=True,
        resolve=True,
        experiments_dir=str(tmp_path),
        exp_id="qvl-golden_1",
    )
    check_golden("slurm_sbatch.sh", result["request"])
    assert result["config"]["config"]["train"]["train_iters"] == 5  # the resolved config carries the override
    assert not (tmp_path / "experiments" / "qvl-golden" / "qvl-golden_1").exists()  # the dry run leaves nothing


@pytest.mark.parametrize(
    ("trainer_api", "golden", "release", "other"),
    [
        ("v2.1", "kubernetes_trainjob.yaml", "v2.1.0", "v2.3.0"),
        ("v2.2+", "kubernetes_trainjob_v2.2.yaml", "v2.3.0", "v2.1.0"),
    ],
)
def test_kubernetes_manifest_matches_golden_and_the_trainer_crd(
    fake_recipe,
    fake_kubeconfig,
    tmp_path,
    trainer_api,
    golden,
    release,
    other,  # noqa: F811
):
    """Both Kubeflow Trainer APIs render a TrainJob that the release's real CRD schema accepts (and the other
    release's refuses: podTemplateOverrides before v2.2, runtimePatches from v2.2 on)."""
    result = launch(
        fake_recipe,
        [
            "tensor_parallel=4",
            "run.executor.nodes=2",
            f"run.executor.image={IMAGE}",
            "run.executor.data_pvc=qvl-data",
            "run.executor.checkpoints_pvc=qvl-ckpt",
            "run.executor.workdir_pvc=qvl-work",
            "run.executor.namespace=ml",
            "run.executor.image_pull_secrets=[ngc-secret]",
            f"run.executor.trainer_api={trainer_api}",
        ],
        kind="kubernetes",
        dryrun=True,
        experiments_dir=str(tmp_path),
        exp_id="qvl-golden_1",
    )
    # The TrainJob name ends in a per-launch uuid so relaunches never collide; fix it for the comparison.
    manifest = re.sub(r"(name: qvl-test-tiny-sft)-[0-9a-f]{6}\n", r"\1-XXXXXX\n", result["request"])
    manifest = re.sub(r"/qvl-workdir/[^/]+/", "/qvl-workdir/USER/", manifest)  # the submitting user's name
    check_golden(golden, manifest)
    trainjob = yaml.safe_load(manifest.split("\n---\n")[0])
    assert trainjob_errors(trainjob, release) == []
    assert trainjob_errors(trainjob, other)  # the field the other release does not have
    assert "ngc-secret" in manifest


def test_crd_validation_refuses_a_field_the_schema_does_not_have():
    trainjob = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "x"}}
    trainjob["spec"] = {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": 1, "image": "i"}}
    for release in TRAINER_RELEASES:
        assert trainjob_errors(trainjob, release) == []
        trainjob["spec"]["trainer"]["numNodez"] = 2
        assert trainjob_errors(trainjob, release) == [
            ".spec.trainer.numNodez: unknown field (the API server drops or refuses it)"
        ]
        trainjob["spec"]["trainer"]["numNodes"] = "two"
        del trainjob["spec"]["trainer"]["numNodez"]
        assert trainjob_errors(trainjob, release) == [".spec.trainer.numNodes: expected integer, got str 'two'"]
        trainjob["spec"]["trainer"]["numNodes"] = 1


def test_local_dryrun_prints_the_command(tmp_path):
    result = launch(
        "demo",
        ["steps=2", "output=out", "run.executor.gpus=0"],
        kind="local",
        dryrun=True,
        experiments_dir=str(tmp_path),
    )
    assert "-m qvl.launchers.cli demo --steps 2 --output out --device cpu" in result["request"]
    assert result["config"]["command"] == "qvl demo --steps 2 --output out --device cpu"


def test_dryrun_of_a_recipe_needing_a_cluster_checkpoint_prints_its_arguments(fake_recipe, tmp_path):
    result = launch(
        "qvl_test_ckpt_sft",
        ["hf_path=/lustre/ckpt", "run.executor.gpus=0"],
        kind="local",
        dryrun=True,
        resolve=True,
        experiments_dir=str(tmp_path),
    )
    assert result["config"]["arguments"] == {"hf_path": "/lustre/ckpt"}
    assert "not built here (FileNotFoundError" in result["config"]["config"]


def test_a_plain_dryrun_prints_what_the_job_runs_without_building_its_config(fake_recipe, tmp_path, monkeypatch):
    """Building the config imports Megatron-Bridge (~15 s); `--dryrun` alone leaves it to `--resolve`."""
    from qvl.launchers import jobs

    monkeypatch.setattr(jobs, "build_job_config", lambda *a: pytest.fail("a plain dry run built the config"))
    pairs = ["tensor_parallel=4", "train.train_iters=5", "run.executor.nodes=2", *SLURM]
    result = launch(fake_recipe, pairs, kind="slurm", dryrun=True, experiments_dir=str(tmp_path))
    assert result["config"]["arguments"] == {"tensor_parallel": 4}
    assert result["config"]["config_overrides"] == {"train.train_iters": 5}
    assert result["config"]["layout"]["tensor_parallel"] == 4 and "--resolve" in result["config"]["config"]
    assert "srun" in result["request"] and result["config"]["rendezvous"].startswith("env (2 node(s) x 8 processes")


def test_resolve_without_dryrun_is_one_line(capsys):
    from qvl.launchers.cli import main

    assert main(["launch", "demo", "--resolve"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --resolve goes with --dryrun (a submit always builds the config first); add --dryrun"
    )


@pytest.mark.slow
def test_local_run_of_a_tiny_recipe_executes_on_cpu(tmp_path):
    """The real thing: NeMo-Run's LocalExecutor runs `qvl train qwen2_5_vl_3b_pretrain --model tiny` on a packed
    sample dataset (CPU runtime, Megatron-Bridge's loop) and the experiment succeeds."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main
    from qvl.training.loop import read_losses

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=16, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen2_5_vl")
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(jsonl),
                "--media-root",
                str(media),
                "--family",
                "qwen2_5_vl",
                "--hf-path",
                str(hf),
                "--seq-length",
                "256",
                "--output",
                str(tmp_path / "data"),
            ]
        )
        == 0
    )
    run_dir = tmp_path / "run"
    pairs = [
        f"data={tmp_path / 'data'}",
        f"hf_path={hf}",
        "train_iters=2",
        "global_batch_size=2",
        "micro_batch_size=1",
        "seq_length=256",
        "warmup_iters=1",
        "save_interval=100",
        "run.executor.gpus=0",
    ]
    result = launch(
        "qwen2_5_vl_3b_pretrain",
        pairs,
        train_flags=["--model", "tiny", "--run-dir", str(run_dir)],
        kind="local",
        experiments_dir=str(tmp_path / "nemo_run"),
    )
    assert result["states"] == ["SUCCEEDED"], result
    assert sorted(read_losses(run_dir)) == [1, 2]
    assert Path(result["folder"]).is_dir()  # the experiment (status, logs) stays for `nemo experiment ...`


# ---- every check before submission has an error that names the value and the fix ----


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["tensor_parallel=8", "run.executor.nodes=3", "run.executor.gpus_per_node=4"],
            r"world size 12 \(nodes=3 x gpus_per_node=4\) is not divisible by tensor_parallel=8 = 8; use nodes=2 or nodes=4",
        ),
        (
            ["tensor_parallel=4", "pipeline_parallel=4", "run.executor.nodes=1"],
            r"world size 8 .* smaller than the recipe's layout tensor_parallel=4 x pipeline_parallel=4 = 16 ranks; use nodes=2",
        ),
        (
            ["tensor_parallel=2", "expert_parallel=3", "run.executor.nodes=1"],
            r"not divisible by tensor_parallel=2 x expert_parallel=3 = 6",
        ),
        (["tensor_parallel=16", "run.executor.nodes=2"], r"tensor_parallel=16 is larger than gpus_per_node=8"),
    ],
)
def test_layout_that_does_not_fit_the_world_is_refused(fake_recipe, tmp_path, overrides, message):
    with pytest.raises(LaunchError, match=message):
        launch(fake_recipe, overrides + SLURM, kind="slurm", dryrun=True, experiments_dir=str(tmp_path))


def test_registered_layout_applies_without_overrides(fake_recipe, tmp_path):
    """The recipe registers tensor_parallel=2: three CPU processes cannot hold it."""
    with pytest.raises(LaunchError, match=r"world size 3 \(nodes=1 x cpu_processes=3\) is not divisible"):
        launch(fake_recipe, ["run.executor.gpus=0", "run.executor.cpu_processes=3"], kind="local", dryrun=True)


def test_fewer_gpus_than_the_recipe_is_sized_for_is_refused(fake_recipe, tmp_path):
    with pytest.raises(
        LaunchError,
        match=r"recipe qvl_test_tiny_sft is sized for 8 GPUs but the executor has 4 "
        r"\(nodes=1 x gpus_per_node=4\); use nodes=2",
    ):
        launch(fake_recipe, ["run.executor.gpus_per_node=4", *SLURM], kind="slurm", dryrun=True)
    # With the layout overridden the user has judged the memory: the same world is accepted.
    launch(
        fake_recipe,
        ["tensor_parallel=4", "run.executor.gpus_per_node=4", *SLURM],
        kind="slurm",
        dryrun=True,
        experiments_dir=str(tmp_path),
    )


@pytest.mark.parametrize("missing", ["account", "partition"])  # container_image is optional (a bare Slurm)
def test_slurm_without_account_or_partition_is_refused(fake_recipe, missing):
    settings = [s for s in SLURM if f".{missing}=" not in s]
    with pytest.raises(LaunchError, match=rf"the slurm executor needs {missing}: .*run.executor.{missing}=\.\.\."):
        launch(fake_recipe, settings, kind="slurm", dryrun=True)


def test_kubernetes_without_image_is_refused(fake_recipe):
    with pytest.raises(LaunchError, match=r"the kubernetes executor needs image"):
        launch(fake_recipe, ["run.executor.nodes=1"], kind="kubernetes", dryrun=True)


def test_unreadable_mount_is_refused_in_a_dry_run(fake_recipe, tmp_path):
    # sbatch on this host: mounts must be readable here (and the experiments folder is --experiments-dir)
    local_tunnel = [s for s in SLURM if ".host=" not in s and ".job_dir=" not in s]
    with pytest.raises(LaunchError, match=r"mount '/nonexistent/qvl-data:/data': /nonexistent/qvl-data does not exist"):
        launch(
            fake_recipe,
            [*local_tunnel, "run.executor.mounts=[/nonexistent/qvl-data:/data]"],
            kind="slurm",
            dryrun=True,
            experiments_dir=str(tmp_path),
        )


def test_ssh_without_job_dir_is_refused(fake_recipe):
    settings = [s for s in SLURM if ".job_dir=" not in s]
    with pytest.raises(LaunchError, match=r"needs job_dir"):
        launch(fake_recipe, settings, kind="slurm", dryrun=True)


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        (FAKE_RECIPE, ["tensorparallel=4"], r"'tensorparallel' is not a recipe option; did you mean tensor_parallel"),
        (FAKE_RECIPE, ["run.executor.nodez=2"], r"the slurm executor has no setting nodez"),
        (FAKE_RECIPE, ["run.executor.ntasks_per_node=2"], r"the slurm executor has no setting ntasks_per_node"),
        (FAKE_RECIPE, ["tensor_parallel"], r"is not key=value"),
        (FAKE_RECIPE, ["tensor_parallel=0"], r"tensor_parallel=0 must be a positive integer"),
        ("qvl_test_ckpt_sft", [], r"recipe qvl_test_ckpt_sft needs hf_path; pass hf_path=\.\.\."),
        ("no_such_recipe", [], r"no recipe named 'no_such_recipe'"),
    ],
)
def test_bad_overrides_are_refused(fake_recipe, recipe, overrides, message):
    with pytest.raises(QvlError, match=message):
        launch(recipe, overrides + SLURM, kind="slurm", dryrun=True)


def test_unknown_config_field_is_refused_where_the_config_is_built(fake_recipe, tmp_path):
    """`--dryrun --resolve` builds the config as a submit does (before sbatch), so both refuse a misspelt field."""
    with pytest.raises(
        QvlError, match=r"override train.train_iterz: train \(TrainSection\) has no field 'train_iterz'"
    ):
        launch(fake_recipe, ["train.train_iterz=5", *SLURM], kind="slurm", dryrun=True, resolve=True,
               experiments_dir=str(tmp_path))  # fmt: skip


# ---- site file and the qvl CLI ----


def test_site_file_holds_executor_settings(fake_recipe, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(
        f"slurm:\n  account: acct\n  partition: batch\n  container_image: {IMAGE}\n  host: login\n"
        "  job_dir: /lustre/qvl\n  nodes: 4\n"
    )
    result = launch(
        fake_recipe,
        ["run.executor.nodes=2"],
        kind="slurm",
        site_file=str(site),
        dryrun=True,
        experiments_dir=str(tmp_path),
    )
    assert "#SBATCH --nodes=2" in result["request"]  # the command line wins over the site file
    assert "#SBATCH --account=acct" in result["request"]


def test_site_file_refuses_secrets(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("kubernetes:\n  image: img\n  env_vars:\n    HF_TOKEN: hf_abc\n")
    with pytest.raises(LaunchError, match=r"'HF_TOKEN' looks like a secret"):
        load_site_config(site, "kubernetes")
    # Secret *names* are not secrets: every nvcr.io image needs an image pull secret's name.
    site.write_text("kubernetes:\n  image: img\n  image_pull_secrets: [ngc-secret]\n")
    assert load_site_config(site, "kubernetes")["image_pull_secrets"] == ["ngc-secret"]


def test_qvl_launch_cli_dryrun_and_error(capsys, tmp_path):
    assert (
        cli.main(["launch", "demo", "steps=2", "run.executor.gpus=0", "--dryrun", "--experiments-dir", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "local request (dry run, nothing submitted)" in out and "qvl demo --steps 2 --device cpu" in out
    assert cli.main(["launch", "demo", "bogus=1", "--dryrun"]) == 2
    assert capsys.readouterr().err.startswith("error: 'bogus' is not a recipe option")


def test_train_flags_pass_through_and_tiny_models_drop_the_registered_layout(fake_recipe):
    job = resolve_job(FAKE_RECIPE, ["pipeline_parallel=2"], ["--model", "tiny", "--run-dir", "runs/x"])
    assert job.argv == ["train", FAKE_RECIPE, "pipeline_parallel=2", "--model", "tiny", "--run-dir", "runs/x"]
    assert (job.layout.tensor_parallel, job.layout.pipeline_parallel) == (1, 2)  # registered tensor_parallel=2 dropped


def test_demo_job_argv():
    assert resolve_job("demo", ["steps=3"]).argv == ["demo", "--steps", "3"]


def test_a_preference_recipes_reference_pass_launches_like_its_training(tmp_path):
    """`qvl launch RECIPE ... --reference`: the job runs `qvl reference` with the same arguments, at the same layout."""
    job = resolve_job("qwen2_5_vl_3b_dpo", ["data=/lustre/pairs", "tensor_parallel=2"], ["--run-dir", "runs/x"],
                      task="reference")  # fmt: skip
    assert job.argv == ["reference", "qwen2_5_vl_3b_dpo", "data=/lustre/pairs", "tensor_parallel=2", "--run-dir",
                        "runs/x"]  # fmt: skip
    assert job.layout.tensor_parallel == 2
    pairs = ["data=/lustre/pairs", "run.executor.gpus=0"]
    result = launch("qwen2_5_vl_3b_dpo", pairs, kind="local", dryrun=True, experiments_dir=str(tmp_path),
                    task="reference")  # fmt: skip
    assert "-m qvl.launchers.cli reference qwen2_5_vl_3b_dpo data=/lustre/pairs" in result["request"]
    with pytest.raises(LaunchError, match="task 'eval' is not one of train, reference"):
        resolve_job("qwen2_5_vl_3b_dpo", [], task="eval")
