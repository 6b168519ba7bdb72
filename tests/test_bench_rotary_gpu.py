"""`benchmarks/bench_rotary_gpu.py`: the vision rotary's bytes per second, forward and backward. On CPU the harness
runs small shapes eagerly (as `gpu.sh rehearse` does); on a GPU the census shapes are held to the goal: the rotary as
qvl runs it (`region_qkv`) at >= 60% of HBM bandwidth each way, and as close to fp64 as transformers' eager rotary."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_rotary_gpu


def test_tiny_rotary_benchmark_writes_every_variant(tmp_path):
    assert bench_rotary_gpu.main(["--tiny", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_rotary_gpu.json").read_text())
    assert set(results["variants"]) == {"eager", "stacked_all_dynamic", "swapped_all_dynamic", "region", "region_qkv"}
    shape = bench_rotary_gpu.SHAPES["tiny"]
    tensor, tables = 256 * 4 * 40 * 2, 2 * 256 * 40 * 4
    assert results["bytes"]["forward"] == 4 * tensor + tables == results["bytes"]["backward"]
    assert results["bytes_qkv"] == {"forward": 4 * tensor + tables, "backward": 6 * tensor + tables}
    for row in results["variants"].values():
        assert row["forward_us"] > 0 and row["backward_us"] > 0 and row["forward_bandwidth_share"] is None
        assert 0 < row["fp64_error"]["forward"] < 8e-3 and 0 < row["fp64_error"]["backward"] < 8e-3  # bf16 rounding
    assert shape == results["shape"]
    assert [c["met"] for c in results["checks"]] == [True, True]  # fp64 error / eager's, forward and backward


def test_the_goals_pair_is_measured_first_and_each_variant_is_written_as_it_ends():
    """On a GPU each variant compiles cold within the stage's time limit: eager and qvl's rotary as training runs it
    come first, their checks as soon as both are measured, and `on_variant` (main: the JSON) sees every variant."""
    import torch

    seen = []
    bench_rotary_gpu.benchmark("tiny", 1, torch.device("cpu"), on_variant=lambda r: seen.append(
        (list(r["variants"]), len(r["checks"]))))  # fmt: skip
    assert [names[-1] for names, _ in seen] == ["eager", "region_qkv", "region", "stacked_all_dynamic",
                                                "swapped_all_dynamic"]  # fmt: skip
    assert [checks for _, checks in seen] == [0, 2, 2, 2, 2]  # fp64 error / eager's, each way (no bandwidth on CPU)


def test_the_census_shapes_without_a_gpu_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_rotary_gpu.main([]) == 2
    assert "--tiny" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_vision_rotary_region_moves_at_least_60_percent_of_hbm_bandwidth(tmp_path, record_property):
    assert bench_rotary_gpu.main(["--repeats", "10", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_rotary_gpu.json").read_text())
    for name, row in results["variants"].items():  # the figures in the tests' XML, passed or failed
        for way in ("forward", "backward"):
            record_property(f"{name}_{way}_bandwidth_share", row[f"{way}_bandwidth_share"])
    failed = [f"{c['figure']}: {c['value']} (goal {c['goal']})" for c in results["checks"] if not c["met"]]
    assert not failed, failed
