"""`benchmarks/bench_train.py` end to end with the tiny model on CPU (real shapes run on a GPU: benchmarks/gpu.sh):
prepare a LLaVA-like dataset, train packed and padded through Megatron-Bridge's pretrain(), and report throughput,
FLOPs three ways, data wait and the loader's packs/s with and without worker processes."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow  # more than ~20 s on 2 cores
def test_tiny_training_benchmark_writes_every_figure(tmp_path):
    from benchmarks import bench_train

    assert (
        bench_train.main(["--model", "tiny", "--profile", "--set", "vision_recompute=true", "--out", str(tmp_path)])
        == 0
    )
    results = json.loads((tmp_path / "bench_train.json").read_text())
    (run,) = results["runs"]
    for mode in ("packed", "padded"):
        figures = run[mode]
        assert figures["steps_measured"] == 2 and figures["tokens_per_s_per_gpu"] > 0
        assert 0 <= figures["data_wait_fraction"] < 1
        # Bridge's formula, qvl's cost model and 6N agree within a factor of 2 on the tiny model
        rates = [figures[f"tflops_{name}"] for name in ("megatron_bridge", "qvl_cost_model", "six_n")]
        assert min(rates) > 0 and max(rates) < 2 * min(rates), rates
    assert run["packed_over_padded_tokens_per_s"] > 0
    # --profile adds two profiled steps to the packed run, left out of its figures (steps_measured above)
    profile = (tmp_path / "run-256-packed" / "profile.txt").read_text()
    assert profile.startswith("steps 4-5") and "aten::" in profile
    if not torch.cuda.is_available():
        assert run["packed"]["peak_memory_gib"] is None and run["packed"]["plan"] is None
    assert results["options"] == {"vision_recompute": True}
    (loader,) = results["loader"]
    assert loader["workers_0"] > 0 and loader["workers_2"] > 0
    assert results["checks"][0]["figure"].startswith("loader packs/s")
