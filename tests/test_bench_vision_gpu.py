"""`benchmarks/bench_vision_gpu.py` with a two-block tower on CPU: the harness that times the vision tower whole
and per rank share on a GPU (benchmarks/gpu.sh) runs, and its figures are consistent with the assignment."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_vision_gpu


@pytest.mark.parametrize("model", ["qwen2_5_vl_3b", "qwen2_vl_2b"])
def test_tiny_vision_share_benchmark_writes_its_figures(tmp_path, model):
    args = ["--tiny", "--model", model, "--packs", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert bench_vision_gpu.main(args) == 0
    results = json.loads((tmp_path / "bench_vision_gpu.json").read_text())
    for row in results["tp_split"]:
        tp = row["tensor_parallel"]
        # the busiest of tp shares holds at least 1/tp of the FLOPs and at most all of them
        assert 1 / tp - 1e-9 <= row["flops_share_over_whole"] <= 1
        assert row["whole_s"] > 0 and row["busiest_share_s"] > 0
    skew = results["dp_skew"]
    # the heavy pack next to the light one is skewed by FLOPs; balancing brings the busiest rank closer to the mean
    assert skew["flops_max_over_mean_before"] > 1
    assert skew["flops_max_over_mean_after"] < skew["flops_max_over_mean_before"]
    assert results["per_image"] and all(r["seconds"] > 0 for r in results["per_image"])
    assert {c["figure"].split(":")[0] for c in results["checks"]} >= {"DP=2 skewed pairs"}


def test_real_shapes_without_a_gpu_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a CPU-only machine reports
    assert bench_vision_gpu.main(["--model", "qwen2_vl_2b"]) == 2
    assert "--tiny" in capsys.readouterr().err
