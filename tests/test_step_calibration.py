"""`benchmarks/step_calibration.py`: the step model refitted to a GPU run's profiled step (issue 38's census that
predicts the GPU). The GPU run is written here as `bench_train` writes it; the census is the RESULTS.md
configuration's figures as the census took them (benchmarks/README.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import bench_step, step_calibration, step_model
from benchmarks.step_model import BEFORE_CENSUS, StepTimeModel

ROOT = pathlib.Path(__file__).resolve().parents[1]

CENSUS = {  # qwen2_5_vl_3b_12l, 2026-11-28 (afternoon, in-place writes counted): python -m benchmarks.bench_step --config qwen2_5_vl_3b_12l
    "config": {"name": "qwen2_5_vl_3b_12l", "vision_recompute": False},
    "step": {"kernel_launching_ops": 12665, "view_ops": 18453, "host_syncs": 7, "gemm_tflop": 530.8725,
             "gemm_misaligned_tflop": 0.0, "attention_tflop": 17.199, "nongemm_gb": 699.127, "h2d_pageable": 0},
    "cuda_graphs": {"host_launches": 1145, "view_ops": 2349, "tower_launching_ops": 8952, "tower_view_ops": 10248,
                    "tower_replay_launches": 120},
}  # fmt: skip


@pytest.fixture
def previous() -> StepTimeModel:
    return StepTimeModel.calibrated(json.loads(BEFORE_CENSUS.read_text()))


def bench_train_json(path, *, step_s=1.4, idle=0.3, graphed=True, tower_calls=None, planned=None, profile=True,
                     error=None, problem=None):  # fmt: skip
    """A bench_train.json whose base packed 4k run took `step_s`, its GPU idle for `idle` of the profiled step, its
    tower's calls by kind `tower_calls` (qvl.kernels.tower_graphs stats; default: replayed but for the first two)."""
    busy = step_s * (1 - idle)
    tower = {"calls": tower_calls or {"warm-up": 1, "captured": 1, "replayed": 46}} if graphed else None
    graphs = {"requested": True, "created": graphed, "vision_tower": tower}
    result = {"step_seconds": step_s, "patch_groups": {"cuda_graphs": graphs}}
    if profile:
        result["profile"] = {"device": "cuda kernels", "gpu_busy_s": busy, "gpu_idle_s": step_s * idle,
                             "work_s": {"gemm": 0.6 * busy, "attention": 0.1 * busy, "elementwise": 0.25 * busy,
                                        "optimizer": 0.04 * busy, "other": 0.01 * busy}}  # fmt: skip
    if problem is not None:  # what profile_breakdown writes where the profiler recorded no device activity
        result["profile"] |= {"gpu_busy_s": None, "gpu_idle_s": None, "profile_problem": problem}
    if planned is not None:
        result["vision_recompute_from_plan"] = planned
    if error is not None:
        result = {"error": error}
    variants = [{"name": "4096-packed", "seq_length": 4096, "mode": "packed", "base": True, "result": result},
                {"name": "8192-packed", "seq_length": 8192, "mode": "packed", "base": True, "result": {"error": "OOM"}}]  # fmt: skip
    path.write_text(json.dumps({"device": "NVIDIA H200", "variants": variants}))
    return path


def test_a_graphed_towers_pad_rows_are_work_the_measured_gpu_did(tmp_path, previous):
    """The graphed step's GPU work includes the tower's pad rows (the census's `pad_work`): the refit divides the
    measured kernel seconds by that work, and reproduces the measured step with it."""
    padded = {**CENSUS, "cuda_graphs": {**CENSUS["cuda_graphs"], "pad_work": {
        "gemm_tflop": 17.3, "gemm_misaligned_tflop": 0.0, "attention_tflop": 0.75, "nongemm_gb": 25.3}}}  # fmt: skip
    measured = step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "b.json", idle=0.02))
    model = step_calibration.recalibrated(previous, padded, measured)
    assert step_calibration.estimated_step_s(model, padded, graphed=True) == pytest.approx(measured.step_s)
    work = step_model.with_pad_work(padded["step"], padded["cuda_graphs"])
    assert work["gemm_tflop"] == pytest.approx(CENSUS["step"]["gemm_tflop"] + 17.3)
    assert model.parts(work)["gemm_aligned_s"] == pytest.approx(measured.gemm_s)
    assert model.parts(CENSUS["step"])["gemm_aligned_s"] < measured.gemm_s  # without them: less than it measured


def test_a_run_whose_tower_ran_eagerly_is_fitted_with_the_layers_graphs_only(tmp_path, previous):
    """bench_train records the tower's calls by kind: where most ran eagerly (a bucket's capture failed, say), the
    run's host launched the tower's ops, and the host's cost per launch is fitted to those launches, not to the
    graphed tower's replays."""
    eager = {"warm-up": 1, "captured": 1, "eager": 46}
    measured = step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "b.json", tower_calls=eager))
    assert measured.graphed and not measured.tower_graphed
    graphed = step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "g.json"))
    assert graphed.tower_graphed
    host = step_calibration.host_ops(CENSUS, graphed=True, tower_graphed=False)
    assert host == 1145 + 2349 + 8952 + 10248 - 120  # the tower's ops back, its replays' launches gone
    assert step_calibration.host_ops(CENSUS, graphed=True) == 1145 + 2349
    model = step_calibration.recalibrated(previous, CENSUS, measured)  # 30% idle: host-bound
    assert model.host_s_per_op == pytest.approx(measured.step_s / host)
    assert step_calibration.estimated_step_s(model, CENSUS, graphed=True, tower_graphed=False) == pytest.approx(1.4)


@pytest.mark.parametrize("idle, graphed", [(0.3, True), (0.3, False), (0.02, True)])
def test_the_refit_model_reproduces_the_measured_step_from_its_kinds_of_work(tmp_path, previous, idle, graphed):
    measured = step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "b.json", idle=idle,
                                                                             graphed=graphed))  # fmt: skip
    model = step_calibration.recalibrated(previous, CENSUS, measured)
    assert step_calibration.estimated_step_s(model, CENSUS, graphed=graphed) == pytest.approx(measured.step_s)
    parts = model.parts(CENSUS["step"])
    assert parts["gemm_aligned_s"] == pytest.approx(measured.gemm_s)
    assert parts["attention_s"] == pytest.approx(measured.attention_s)
    assert parts["elementwise_s"] == pytest.approx(measured.other_work_s)
    host_bound = idle > step_calibration.HOST_BOUND_IDLE
    # a host-bound step fits the host's cost per launch to the launches the run made; otherwise it is kept
    expected_host = measured.step_s / step_calibration.host_ops(CENSUS, graphed=graphed)
    assert (model.host_s_per_op == pytest.approx(expected_host)) == host_bound
    assert (model.host_s_per_op == previous.host_s_per_op) == (not host_bound)


@pytest.mark.parametrize("ratio, met", [(1.05, True), (0.93, True), (1.2, False), (0.8, False)])
def test_the_goal_is_the_estimate_before_the_refit_within_ten_percent(tmp_path, previous, ratio, met):
    estimate = step_calibration.estimated_step_s(previous, CENSUS, graphed=True)
    path = bench_train_json(tmp_path / "b.json", step_s=estimate * ratio)
    check = step_calibration.estimate_check(previous, CENSUS, step_calibration.MeasuredStep.of_bench_train(path))
    assert check["met"] is met and check["value"] == pytest.approx(1 / ratio - 1, abs=1e-4)
    assert "NVIDIA H200, 4096 packed" in check["figure"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"profile": False}, "no GPU profile breakdown; run bench_train with --profile on a GPU"),
        ({"planned": {"vision_recompute": True}}, "recomputed vision blocks .* the census configuration does not"),
        ({"error": "OutOfMemoryError: CUDA out of memory"}, "the packed 4096 run failed \\(OutOfMemoryError"),
        ({"problem": "no device activity in step 9"}, "profile is unusable \\(no device activity in step 9\\)"),
    ],
)
def test_a_run_the_census_configuration_cannot_be_fitted_to_is_refused_saying_why(tmp_path, kwargs, message):
    path = bench_train_json(tmp_path / "b.json", **kwargs)
    with pytest.raises(ValueError, match=message):
        step_calibration.MeasuredStep.of_bench_train(path)
    with pytest.raises(ValueError, match=r"no base packed run at 2048 \(base packed runs at: \[4096, 8192\]\)"):
        step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "c.json"), seq_length=2048)


def test_every_later_census_takes_its_model_from_the_recorded_calibration(tmp_path, previous):
    path = tmp_path / "calibration.json"
    assert step_calibration.current_model(previous, path) == (previous, None)
    measured = step_calibration.MeasuredStep.of_bench_train(bench_train_json(tmp_path / "b.json"))
    step_calibration.write_calibration(CENSUS, measured, path)
    model, source = step_calibration.current_model(previous, path)
    assert source == str(tmp_path / "b.json") and model == step_calibration.recalibrated(previous, CENSUS, measured)
    assert step_calibration.estimated_step_s(model, CENSUS, graphed=True) == pytest.approx(1.4)


def test_the_command_line_refuses_a_calibration_it_cannot_make_before_any_census(tmp_path, capsys):
    good = bench_train_json(tmp_path / "b.json")
    assert bench_step.main(["--config", "tiny", "--calibrate", str(good), "--out", str(tmp_path)]) == 2
    assert "--calibrate needs the census of qwen2_5_vl_3b_12l" in capsys.readouterr().err
    bad = bench_train_json(tmp_path / "bad.json", profile=False)
    assert bench_step.main(["--config", "qwen2_5_vl_3b_12l", "--calibrate", str(bad), "--out", str(tmp_path)]) == 2
    assert "no GPU profile breakdown" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    assert bench_step.main(["--config", "qwen2_5_vl_3b_12l", "--calibrate", str(missing), "--out", str(tmp_path)]) == 2
    assert f"--calibrate {missing}" in capsys.readouterr().err


def test_the_first_fit_is_held_against_the_second_h100_profile(previous):
    """`step_model.second_profile_checks`: a census making the 2026-11-26 run's GEMM and attention calls, whose FLOPs
    the model turns into that profile's device seconds, meets them; 20% more GEMM FLOPs, or one call fewer, does not.
    (The census of the measured configuration: 0.908 / 0.878 s GEMM, 0.218 / 0.219 s attention, benchmarks/RESULTS.md.)"""
    profile = step_model.SECOND_PROFILE
    step = {"ops": dict(profile["calls"]), "gemm_tflop": profile["gemm_s"] * previous.aligned_flops_per_s / 1e12,
            "gemm_misaligned_tflop": 0.0, "attention_tflop": profile["attention_s"] * previous.attention_flops_per_s / 1e12,
            "nongemm_gb": 0.0, "h2d_pageable": 0, "kernel_launching_ops": 0, "view_ops": 0, "host_syncs": 0}  # fmt: skip

    def met(**changes) -> list[bool]:
        return [check["met"] for check in step_model.second_profile_checks({"step": step | changes}, previous)]

    assert met() == [True, True, True]
    assert met(gemm_tflop=1.2 * step["gemm_tflop"]) == [True, False, True]
    assert met(ops={**step["ops"], "mm": step["ops"]["mm"] - 1}) == [False, True, True]


def gpu_tests_xml(path, rates: dict[str, float]):
    """`path` (gpu_tests.xml) as pytest's junit writer makes it where the vision attention's `gpu` test recorded
    `rates` (shape -> TFLOP/s at the kernel's head dim) with tests/kernels/test_gpu.py's label, and another record."""
    module = path.with_name("test_recorded.py")
    cases = "\n".join(
        f"def test_{shape}(record_property):\n"
        f"    label = ATTENTION_RATE_LABEL.format(shape={shape!r}, dim=80, kernel_dim=96)\n"
        f"    record_property(label + ' (torch 2.11.0, cuDNN 91900)', (1.5, {rate * 80 / 96}, {rate}))\n"
        f"    record_property({shape!r} + ': relative error from fp64, varlen / loop', {{'output': (0.002, 0.002)}})\n"
        for shape, rate in rates.items()
    )
    module.write_text(f"from benchmarks.step_calibration import ATTENTION_RATE_LABEL\n\n{cases}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"--junitxml={path}", str(module)], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return path


def test_the_windows_rate_over_whole_images_is_read_from_the_gpu_tests_record(tmp_path):
    both = gpu_tests_xml(tmp_path / "both.xml", {"windows_of_64_head_80": 30.0, "whole_images_head_80": 120.0,
                                                 "whole_images_head_72": 100.0})  # fmt: skip
    assert step_calibration.short_attention_speed(both) == pytest.approx(0.25)
    one = gpu_tests_xml(tmp_path / "one.xml", {"whole_images_head_80": 120.0})  # the windows' test did not run
    assert step_calibration.short_attention_speed(one) is None
    cut = tmp_path / "cut" / "gpu_tests.xml"  # a run killed while pytest wrote it
    cut.parent.mkdir()
    cut.write_text(both.read_text()[:200])
    with pytest.raises(ValueError, match=r"gpu_tests.xml is not a junit XML pytest wrote \(.*\); move it away"):
        step_calibration.short_attention_speed(cut)
    bench_train_json(cut.with_name("bench_train.json"))
    with pytest.raises(ValueError, match="move it away to calibrate without the vision windows' attention rate"):
        step_calibration.MeasuredStep.of_bench_train(cut.with_name("bench_train.json"))


def test_with_the_gpu_tests_record_beside_the_refit_rates_windows_at_their_measured_share(tmp_path, previous):
    """gpu_tests.xml beside bench_train.json: the refit takes the windows' measured share of the longer calls' rate,
    still reproduces the measured attention and step, and then estimates a tower of whole images only (Qwen2-VL's)
    at the longer calls' rate, faster than the one mixed rate would."""
    census = {**CENSUS, "step": {**CENSUS["step"], "attention_short_tflop": 2.72}}
    path = bench_train_json(tmp_path / "bench_train.json")
    mixed = step_calibration.MeasuredStep.of_bench_train(path)
    assert mixed.short_attention_speed == 1.0  # no record beside it
    gpu_tests_xml(tmp_path / "gpu_tests.xml", {"windows_of_64_head_80": 30.0, "whole_images_head_80": 120.0})
    measured = step_calibration.MeasuredStep.of_bench_train(path)
    assert measured.short_attention_speed == pytest.approx(0.25)
    model = step_calibration.recalibrated(previous, census, measured)
    assert model.short_attention_speed == pytest.approx(0.25)
    assert model.parts(census["step"])["attention_s"] == pytest.approx(measured.attention_s)
    assert step_calibration.estimated_step_s(model, census, graphed=True) == pytest.approx(measured.step_s)
    # the same attention FLOPs, none of them in windows: the longer calls' rate, 2.72 * (4 - 1) TFLOP less work
    whole = {**census["step"], "attention_short_tflop": 0.0}
    expected = measured.attention_s * 17.199 / (17.199 + 3 * 2.72)
    assert model.parts(whole)["attention_s"] == pytest.approx(expected)
    one_rate = step_calibration.recalibrated(previous, census, mixed)
    assert one_rate.parts(whole)["attention_s"] == pytest.approx(measured.attention_s)


def test_the_table_says_which_windows_share_the_refit_took():
    results = {"configs": {}, "calibration": "results/h100/bench_train.json", "model": {"short_attention_speed": 0.25}}
    assert "bench_train.json; vision windows' attention at 0.25 of the longer calls' rate" in step_model.table(results)
    results["model"]["short_attention_speed"] = 1.0  # no GPU tests' record beside the run
    assert step_model.table(results).endswith(
        "step model refitted to the measured step of results/h100/bench_train.json"
    )
