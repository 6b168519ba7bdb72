"""`benchmarks/bench_train.py` end to end with the tiny model on CPU (real shapes run on a GPU: benchmarks/gpu.sh):
prepare a LLaVA-like dataset, train packed and padded through Megatron-Bridge's pretrain(), and report throughput,
FLOPs three ways, data wait, the patch groups of each run, a profiled step broken down by kind of work, and the
loader's packs/s with and without worker processes; the variants' command-line spelling."""

from __future__ import annotations

import json
import pathlib
import re
import types

import pytest
import torch

from benchmarks import train_variants
from benchmarks.profile_breakdown import CATEGORIES, classify


@pytest.mark.slow  # more than ~20 s on 2 cores
def test_tiny_training_benchmark_writes_every_figure(tmp_path):
    from benchmarks import bench_train

    variants = ["256:packed", "256:padded", "256:packed:-speed-optimizer:steps=2"]
    argv = ["--model", "tiny", "--profile", "--set", "vision_recompute=true", "--variants", *variants]
    assert bench_train.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_train.json").read_text())
    names = [v["name"] for v in results["variants"]]
    assert names == ["256-packed", "256-padded", "256-packed-no-speed-optimizer"]
    (run,) = results["runs"]
    for mode in ("packed", "padded"):
        figures = run[mode]
        assert figures["steps_measured"] == 2 and figures["tokens_per_s_per_gpu"] > 0
        assert len(figures["step_seconds_each"]) == 2
        assert min(figures["step_seconds_each"]) <= figures["step_seconds_median"] <= max(figures["step_seconds_each"])
        assert 0 <= figures["data_wait_fraction"] < 1
        # Bridge's formula, qvl's cost model and 6N agree within a factor of 2 on the tiny model
        rates = [figures[f"tflops_{name}"] for name in ("megatron_bridge", "qvl_cost_model", "six_n")]
        assert min(rates) > 0 and max(rates) < 2 * min(rates), rates
        assert len(figures["losses"]) == 3 + (2 if mode == "packed" else 0)  # --profile: two more packed steps
        assert all(0 < loss < 20 for loss in figures["losses"])
    assert run["packed_over_padded_tokens_per_s"] > 0
    # what torch.compile did in the run: nothing broke a graph or passed its recompile limit
    compiles = run["packed"]["compiles"]
    assert (compiles["graph_breaks"], compiles["recompile_limit_hits"]) == (0, 0), compiles
    # the groups: the switch's training groups on this device, in place during step 1; one left off where asked
    groups = results["patch_groups"]
    assert "speed-optimizer" in groups["applied_around_loop"] and "speed-optimizer" in groups["applied_in_step_1"]
    assert set(groups["applied_around_loop"]) <= set(groups["applied_in_step_1"]) <= set(groups["decided_on"])
    # the layers and the tower as CUDA graphs (on the CPU recorded and replayed: qvl.foundation.graph_replay)
    graphs = groups["cuda_graphs"]
    assert graphs["requested"] and graphs["created"] and graphs["vision_tower"]["calls"]["replayed"] > 0
    off = results["variants"][2]["result"]
    assert off["steps_measured"] == 1 and off["patch_groups"]["left_off"] == ["speed-optimizer"]
    assert "speed-optimizer" not in off["patch_groups"]["applied_in_step_1"]
    figures = [c["figure"] for c in results["comparisons"]]
    assert figures == ["tokens/s at 256: packed / padded", "tokens/s at 256: with speed-optimizer / without"]
    same_batches = results["comparisons"][1]  # fused and unfused AdamW train the same batches to the same losses
    assert "loss_max_relative_difference" not in results["comparisons"][0]
    assert 0 <= same_batches["loss_max_relative_difference"] < 1e-3, same_batches
    # --profile: two profiled steps after the packed run's, left out of its figures (steps_measured above)
    profile = run["packed"]["profile"]
    assert set(profile["share_of_step"]) == {*CATEGORIES, "idle"}
    assert sum(profile["share_of_step"].values()) == pytest.approx(1, abs=0.01)
    assert profile["work_s"]["gemm"] > 0 and profile["work_s"]["optimizer"] > 0  # AdamW's kernels
    assert "profile" not in run["padded"] and "profile" not in off
    table = (tmp_path / "run-256-packed" / "profile.txt").read_text()
    assert table.startswith("steps 4-5") and "aten::" in table
    if not torch.cuda.is_available():
        assert run["packed"]["peak_memory_gib"] is None and run["packed"]["plan"] is None
    assert results["options"] == {"vision_recompute": True}
    (loader,) = results["loader"]
    assert loader["workers_0"] > 0 and loader["workers_2"] > 0
    assert results["checks"][0]["figure"].startswith("loader packs/s")


def test_variants_read_as_written_and_the_gpu_runs_are_the_issues_figures():
    variant = train_variants.parse("4096:packed:compile=true:-speed-cuda-graphs:steps=5")
    assert (variant.seq_length, variant.mode, variant.steps) == (4096, "packed", 5)
    assert variant.options == (("compile", True),) and variant.groups_off == ("speed-cuda-graphs",)
    assert variant.name == "4096-packed-compile=True-no-speed-cuda-graphs" and not variant.base
    assert train_variants.parse("8192").base and train_variants.parse("8192:padded").mode == "padded"
    with pytest.raises(ValueError, match="'fast' is none of packed, padded"):
        train_variants.parse("4096:fast")
    real = [train_variants.parse(text) for text in train_variants.REAL_SHAPES]
    base = {(v.seq_length, v.mode) for v in real if v.base}
    assert base == {(4096, "packed"), (4096, "padded"), (8192, "packed")}  # packed and padded on the same samples
    assert any(dict(v.options).get("compile") for v in real)  # compile on (off: the base run)
    assert any(v.groups_off == ("speed-cuda-graphs",) for v in real)  # the graphs' own effect


def test_a_real_shape_run_recomputes_as_few_vision_blocks_as_its_plan_on_the_gpu_needs(tmp_path):
    """The census configuration's runs (12 LM layers, the whole ViT) on an H100: none at 4k; at 16k some of the first
    blocks (the plan with them under the headroom, with one fewer over it); every block off the planner's GPUs."""
    from benchmarks import bench_train, train_plan
    from qvl.recipes.planner import GIB, GPUS, plan_config
    from qvl.training.loop import TrainRequest, prepare_config

    hf_path = bench_train.write_model_dir(tmp_path / "hf", "qwen2_5_vl_3b", 12)

    def spec(seq_length: int) -> dict:
        return {"recipe": "qwen2_5_vl_3b_pretrain", "tiny": False, "run_dir": str(tmp_path / "run"),
                "overrides": {"hf_path": str(hf_path), "seq_length": seq_length, "global_batch_size": 8}}  # fmt: skip

    assert train_plan.vision_recompute_from_plan(spec(4096), "h100") == {}
    assert train_plan.vision_recompute_from_plan(spec(4096), None) == {"vision_recompute": True}
    planned = train_plan.vision_recompute_from_plan(spec(16384), "h100")
    blocks = planned["vision_recompute_blocks"]
    assert planned["vision_recompute"] and 0 < blocks < 32

    def total_gib(options: dict) -> float:
        request = TrainRequest(recipe="qwen2_5_vl_3b_pretrain", overrides={**spec(16384)["overrides"], **options},
                               run_dir=tmp_path / "run")  # fmt: skip
        return plan_config(prepare_config(request, cpu=False)[1], gpus=1, gpu="h100").worst.total / GIB

    limit = train_plan.PLAN_HEADROOM * GPUS["h100"].memory_gib
    assert total_gib(planned) <= limit < total_gib({**planned, "vision_recompute_blocks": blocks - 1})


def test_a_run_whose_process_dies_gets_an_error_and_the_rest_still_train(tmp_path, monkeypatch):
    """One GPU call, no second chance: a training process that dies without its run's result (killed for memory, a
    crash in a kernel) gives that run an error as its result and the runs after it still train in a fresh process;
    the processes write into train_log.txt as they run (a run cut off by the stage's limit leaves its log)."""
    import subprocess

    from benchmarks import bench_train

    specs, results = [], []
    for index in range(3):
        results.append(tmp_path / f"result-{index}.json")
        specs.append(tmp_path / f"spec-{index}.json")
        specs[-1].write_text(json.dumps({"result": str(results[-1])}))
    commands = []

    def run(command, *, stdout, stderr, cwd):
        assert stderr is subprocess.STDOUT and stdout.name == str(tmp_path / "train_log.txt")
        pending = [pathlib.Path(arg) for arg in command[command.index("--worker") + 1 :]]
        commands.append([p.name for p in pending])
        stdout.write(f"training {pending[0].name}\n")
        if len(commands) == 1:  # the first process dies in its first run (SIGKILL)
            return subprocess.CompletedProcess(command, -9)
        for spec in pending:
            pathlib.Path(json.loads(spec.read_text())["result"]).write_text('{"losses": [1.0]}')
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bench_train.subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one run per process, as on a GPU
    seen = []
    setup = types.SimpleNamespace(out=tmp_path)
    got = bench_train.train_all(setup, specs, on_result=lambda index, result: seen.append(index))
    assert commands == [["spec-0.json"], ["spec-1.json"], ["spec-2.json"]]
    assert got[0] == {"error": "the run's process ended with exit -9 before its result (see train_log.txt)"}
    assert got[1:] == [{"losses": [1.0]}] * 2 and seen == [0, 1, 2]
    assert (tmp_path / "train_log.txt").read_text().splitlines() == [f"training spec-{i}.json" for i in range(3)]


def test_a_profile_without_device_activity_gives_no_idle_and_no_shares(tmp_path):
    """CUPTI can record nothing (profiling around graph captures is a known case): that is no figure, not a GPU idle
    for the whole step with every kind of work at zero; the checks then leave the idle goal out."""
    from benchmarks.profile_breakdown import StepBreakdown

    breakdown = StepBreakdown(tmp_path / "profile.txt", first=4)
    breakdown.cuda = True
    breakdown.profiler = types.SimpleNamespace(profiler=types.SimpleNamespace(
        kineto_results=types.SimpleNamespace(events=lambda: [])))  # fmt: skip
    breakdown._busy(1.5)
    breakdown.result["work_s"] = dict.fromkeys(CATEGORIES, 0.0)
    summary = breakdown.summary()
    assert summary["gpu_idle_share"] is None and summary["share_of_step"] is None and summary["device_events"] == 0
    assert summary["profile_problem"] == "the profiler recorded no device activity in step 4: idle and shares unknown"
    packed = {"profile": summary, "data_wait_fraction": 0.01, "mfu_megatron_bridge": 0.3}
    checks = train_variants.checks({"loader": [], "gpu_kind": "h100", "runs": [{"seq_length": 4096, "packed": packed}]})
    assert [c["figure"] for c in checks] == [
        "data-wait fraction at 4096",
        "MFU (Megatron-Bridge formula), packed at 4096",
    ]


def test_the_plan_beside_a_real_shape_runs_figures_is_made_from_its_measured_steps(tmp_path):
    """On a GPU each packed run's result carries `qvl plan`'s memory for it, made from the steps it measured (a path
    the CPU's tiny runs skip: they have no GPU kind); the census configuration's run at 4k as the H100 gives it."""
    from benchmarks import bench_train, train_plan
    from qvl.training.loop import TrainRequest, prepare_config

    hf_path = bench_train.write_model_dir(tmp_path / "hf", "qwen2_5_vl_3b", 12)
    overrides = {"hf_path": str(hf_path), "seq_length": 4096, "global_batch_size": 8}
    config = prepare_config(TrainRequest(recipe="qwen2_5_vl_3b_pretrain", overrides=overrides, run_dir=tmp_path / "r"),
                            cpu=False)[1]  # fmt: skip
    steps = [{"lengths": [780] * 5, "grids": [[1, 44, 44]] * 5} for _ in range(8)]  # 8 packs of 5 LLaVA-like samples
    plan = train_plan.planner_estimate(config, steps, "h100")
    parts = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "overhead_gib")
    assert plan["gpu"] == "h100" and 0 < plan["mfu_estimate"] < 1
    assert plan["total_gib"] == pytest.approx(sum(plan[part] for part in parts), abs=0.05)
    assert train_plan.planner_estimate(config, steps, None) is None  # off the planner's GPUs


def test_kernels_are_classified_by_kind():
    assert classify("nvjet_sm90_tss_192x192_64x3_1x2_h_badd_coopB_NTN") == "gemm"
    assert classify("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128>>") == "attention"
    assert classify("triton_poi_fused__to_copy_add_mul_0") == "elementwise"
    assert classify("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>") == "optimizer"
    assert classify("Memcpy HtoD (Pinned -> Device)") == "other" and classify("aten::addmm") == "gemm"


# A graphed run's test on either device: recorded and replayed on the CPU (slow), captured on a GPU (gpu); each case
# runs only where its device is.
EITHER_DEVICE = pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)


LOSS_REL = {"cpu": 1e-5, "cuda": 3e-2}  # fp32 recorded replays; bf16 kernels at the graphs' other shapes


def _on(device: str) -> None:
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("this machine runs the cuda case")


def _graphed_and_eager(tmp_path, model: str, *extra: str, steps: int = 4) -> tuple[dict, dict]:
    """`bench_train`'s tiny `model` trained with speed-cuda-graphs and without (`extra`: more arguments): both runs'
    results, the graphed one without an error."""
    from benchmarks import bench_train

    variants = [f"256:packed:steps={steps}", f"256:packed:-speed-cuda-graphs:steps={steps}"]
    assert bench_train.main(["--model", model, *extra, "--variants", *variants, "--out", str(tmp_path)]) == 0
    graphed, eager = (v["result"] for v in json.loads((tmp_path / "bench_train.json").read_text())["variants"])
    assert "error" not in graphed, graphed.get("error")
    return graphed, eager


@EITHER_DEVICE
def test_cuda_graphs_train_as_the_eager_layers_do(device, tmp_path):
    """speed-cuda-graphs: the tiny model's layers captured after step 1 and replayed, and its tower's buckets, with
    the eager layers' losses (on a GPU the graphed run's packs padded to seq_length: bf16 GEMMs of other shapes)."""
    _on(device)
    graphed, eager = _graphed_and_eager(tmp_path, "tiny")
    graphs = graphed["patch_groups"]["cuda_graphs"]
    assert graphs["requested"] and graphs["created"] and graphs["tower_requested"], graphs
    assert graphs["vision_tower"]["calls"].get("replayed", 0) > 0, graphs
    assert eager["patch_groups"]["cuda_graphs"] == {"requested": False, "tower_requested": False}
    assert graphed["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL[device])


@EITHER_DEVICE
def test_the_qwen3_vl_tower_trains_graphed_as_it_does_eagerly(device, tmp_path):
    """speed-cuda-graphs with Megatron-Bridge's Qwen3-VL vision tower (qvl.kernels.tower_graphs.MegatronTowerGraphs):
    buckets captured and replayed, none failing to capture, and the eager run's losses."""
    _on(device)
    graphed, eager = _graphed_and_eager(tmp_path, "tiny_qwen3_vl", steps=6)
    tower = graphed["patch_groups"]["cuda_graphs"]["vision_tower"]
    assert tower is not None and tower["calls"].get("captured", 0) >= 1, tower
    assert not [reason for reason in tower["eager_because"] if "capture failed" in reason], tower
    assert graphed["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL[device])


@EITHER_DEVICE
def test_a_moe_models_routers_and_combines_train_graphed_as_they_do_eagerly(device, tmp_path):
    """speed-cuda-graphs with MoE layers (Qwen3-VL-MoE): each layer's attention, its router (with the all-to-all
    dispatcher's preprocessing, whose counts come to the host in the graph's copies) and its combine captured and
    replayed, the experts eager; the eager run's losses (its packs unpadded, the graphed run's pad masked out of the
    balancing loss)."""
    _on(device)
    graphed, eager = _graphed_and_eager(tmp_path, "tiny_qwen3_vl_moe")
    graphs = graphed["patch_groups"]["cuda_graphs"]
    assert graphs["requested"] and graphs["created"], graphs
    assert graphs["moe_blocks"]["partial"] > 0 and graphs["moe_blocks"]["whole"] == 0, graphs
    assert graphed["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL[device])


@pytest.mark.gpu
def test_a_moe_models_whole_moe_blocks_train_graphed_as_they_do_eagerly(tmp_path):
    """speed-cuda-graphs with grouped experts on one rank (Qwen3-VL-MoE, bf16 on the GPU's CUTLASS grouped GEMMs):
    each MoE layer's whole MoE block captured and replayed as one graph each way (qvl.kernels.moe_block_graphs), no
    layer falling back to the router and combine graphs; the eager run's losses. On the CPU:
    tests/kernels/test_speed_cuda_graphs_moe.py."""
    graphed, eager = _graphed_and_eager(tmp_path, "tiny_qwen3_vl_moe", "--set", "grouped_experts=true")
    graphs = graphed["patch_groups"]["cuda_graphs"]
    assert graphs["requested"] and graphs["created"], graphs
    assert graphs["moe_blocks"]["whole"] > 0 and graphs["moe_blocks"]["partial"] == 0, graphs
    assert "speed-grouped-experts" in graphed["patch_groups"]["applied_around_loop"], graphed["patch_groups"]
    assert graphed["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL["cuda"])


@pytest.mark.gpu
def test_qwen3_5s_attention_layers_train_graphed_around_its_gated_deltanet_layers_as_they_do_eagerly(tmp_path):
    """speed-cuda-graphs with Qwen3.5-VL on a GPU: its full-attention layers and its Gated DeltaNet layers' MLPs
    captured and replayed, the Gated DeltaNets on flash-linear-attention's kernels eager (the graphed run's packs
    padded to seq_length, with zero-length sub-sequences after them), reading nothing back
    (speed-gated-delta-sync-free); the eager run's losses. On the CPU: tests/kernels/test_speed_cuda_graphs_hybrid.py."""
    graphed, eager = _graphed_and_eager(tmp_path, "tiny_qwen3_5_vl")
    graphs = graphed["patch_groups"]["cuda_graphs"]
    assert graphs["requested"] and graphs["created"], graphs
    assert {"speed-gated-delta-sync-free", "speed-gated-delta-l2norm"} <= set(
        graphed["patch_groups"]["applied_around_loop"]
    )
    for run in (graphed, eager):  # fla's l2norm no longer splits Megatron-Core's compiled input preparation
        compiles = run["compiles"]
        assert not [r for r in compiles["graph_break_reasons"] if re.search(r"\bfla\b|l2norm", r)], compiles
        assert not compiles["recompile_limit_hits"], compiles
    assert graphed["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL["cuda"])


@EITHER_DEVICE
def test_the_tower_alone_trains_graphed_where_the_layers_cannot_be(device, tmp_path):
    """speed-cuda-graphs under full recompute (Megatron-Core cannot make the layers' graphs): the layers eager, the
    vision tower's buckets captured and replayed alone, and the eager run's losses."""
    _on(device)
    graphed, eager = _graphed_and_eager(tmp_path, "tiny", "--set", "recompute=full")
    graphs = graphed["patch_groups"]["cuda_graphs"]
    assert not graphs["requested"] and graphs["tower_requested"], graphs
    assert graphs["vision_tower"]["calls"].get("replayed", 0) > 0, graphs
    assert not [reason for reason in graphs["vision_tower"]["eager_because"] if "capture failed" in reason], graphs
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=LOSS_REL[device])
