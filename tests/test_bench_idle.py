"""`benchmarks/bench_idle.py`: one run whose global batch grows through 1 -> 2 packs (2 -> 8 on a GPU), with
Megatron-Bridge's timers and, on CUDA, the GPU's busy time per step; the fits that split a step's time into a fixed
cost and a cost per pack."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_idle
from benchmarks.step_anatomy import batch_size_schedule, busy_seconds


def test_schedule_becomes_megatron_step_batch_size_schedule():
    schedule = bench_idle.schedule_of((2, 4, 6, 8), 3)
    assert schedule == [2, 2, 2, 4, 4, 4, 6, 6, 6, 8, 8, 8]
    # thresholds are samples consumed before the step: 3 steps of 2 -> 6, then 3 of 4 -> 18, then 3 of 6 -> 36
    assert batch_size_schedule(schedule) == "0:2 6:4 18:6 36:8"


def test_busy_time_is_the_union_of_device_intervals():
    # overlapping kernels on two streams count once; a gap counts nothing
    assert busy_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(30e-9)
    assert busy_seconds([]) == 0


def test_analysis_fits_fixed_and_per_pack_cost_and_checks_idle():
    steps = []
    for packs in (2, 4, 8):
        for i in range(3):
            wall = 1.0 + 0.5 * packs + (0.3 if i == 0 else 0.0)  # first step of a size is slower, left out
            steps.append({"packs": packs, "wall_s": wall, "timers_s": {"forward-backward": 0.5 * packs}})
    steps[-1] |= {"gpu_busy_s": 4.5, "gpu_idle_fraction": 0.1}
    result = bench_idle.analyse(steps)
    assert result["wall_fit"] == {"fixed_s": 1.0, "per_pack_s": 0.5, "points": 6}
    assert [row["packs"] for row in result["per_size"]] == [2, 4, 8]
    assert result["per_size"][-1]["gpu_idle_fraction"] == 0.1
    (check,) = result["checks"]
    assert check["value"] == 0.1 and not check["met"]


def test_sizes_must_grow(capsys):
    assert bench_idle.main(["--sizes", "4", "2"]) == 2
    assert "must grow" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_grows_its_batch_in_one_process(tmp_path):
    assert bench_idle.main(["--model", "tiny", "--steps-per-size", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_idle.json").read_text())
    assert results["schedule"] == [1, 1, 2, 2]
    assert [step["packs"] for step in results["steps"]] == [1, 1, 2, 2]  # the loader was asked for what was planned
    for row in results["per_size"]:
        timers = row["timers_s"]
        assert 0 < timers["forward-compute"] <= timers["forward-backward"] <= row["wall_s"]
        assert timers["optimizer"] > 0
    assert results["wall_fit"]["points"] == 2
