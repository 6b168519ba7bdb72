"""The benchmark runner (`python -m benchmarks.run`) and the conversion benchmark's synthetic checkpoints.

The data and balance benchmarks have their own quick-mode tests under tests/data/.
"""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from rich.console import Console

from benchmarks import run as bench_run
from benchmarks.bench_convert import hf_layout, synthetic_config, write_random_hf_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_discover_finds_every_benchmark():
    assert {"balance", "convert", "data"} <= set(bench_run.discover())


@pytest.fixture
def fake_benchmarks(monkeypatch):
    """Two benchmarks the runner imports by name: one that meets its goal, one that raises."""

    def good(out_dir, quick=False):
        results = {
            "quick": quick,
            "throughput": 3.0,
            "checks": [{"figure": "throughput", "value": 3.0, "goal": ">= 2", "met": True}],
        }
        (out_dir / "bench_fake_good.json").write_text(json.dumps(results))
        return results

    def broken(out_dir, quick=False):
        raise RuntimeError("fake benchmark broke")

    for name, fn in {"fake_broken": broken, "fake_good": good}.items():
        module = types.ModuleType(f"benchmarks.bench_{name}")
        module.run = fn
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(bench_run, "discover", lambda: ["fake_broken", "fake_good"])


def test_a_failing_benchmark_is_reported_and_the_others_still_run(fake_benchmarks, tmp_path):
    (tmp_path / "bench_fake_broken.json").write_text("{}")  # a stale result must not survive a failed run
    console = Console(file=io.StringIO(), width=120)
    outcomes = bench_run.run_all(["fake_broken", "fake_good"], tmp_path, quick=True, console=console)
    assert [o.ok for o in outcomes] == [False, True]
    assert "RuntimeError: fake benchmark broke" in outcomes[0].error
    assert not (tmp_path / "bench_fake_broken.json").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and list(summary["benchmarks"]) == ["fake_broken", "fake_good"]
    assert summary["benchmarks"]["fake_good"]["goal_met"] is True
    printed = console.file.getvalue()
    assert "fake benchmark broke" in printed and "PASS" in printed
    assert bench_run.main(["--quick", "--out", str(tmp_path)]) == 1
    assert bench_run.main(["--quick", "--only", "fake_good", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_synthetic_checkpoint_has_save_pretrained_names_and_loads(tied, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    config = synthetic_config(3, text={"tie_word_embeddings": tied}, vision={})  # tiny widths, 3 layers
    reference = AutoModelForImageTextToText.from_config(config)
    reference.save_pretrained(tmp_path / "reference")
    expected = {}
    for path in (tmp_path / "reference").glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            expected |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert {name: tuple(shape) for name, shape in hf_layout(config).items()} == expected

    sizes = write_random_hf_checkpoint(tmp_path / "synthetic", config, max_shard_bytes=64 * 2**10)
    index = json.loads((tmp_path / "synthetic" / "model.safetensors.index.json").read_text())
    assert sizes["shards"] > 3 and index["weight_map"].keys() == expected.keys()
    model, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "synthetic", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16


@pytest.mark.slow
def test_quick_convert_benchmark_writes_its_json(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "convert", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_convert.json", "summary.json"]
    results = json.loads((tmp_path / "bench_convert.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is True and list(summary["benchmarks"]) == ["convert"]
    (row,) = results["depths"]
    # The quick model is small: its conversion's peak RSS is within noise of the tiny baseline's (a clean-clone CI
    # run measured 8 MB below it), so only the bookkeeping is asserted here; tests/bridges/test_memory.py holds the
    # memory goal on checkpoints large enough to measure.
    constant = results["constant"]["peak_rss_bytes"]
    assert row["shards"] >= 3 and row["peak_rss_bytes"] > 0 and constant > 0
    assert row["growth_bytes"] == row["peak_rss_bytes"] - constant
    assert row["megatron_checkpoint_bytes"] >= row["weight_bytes"]
    assert isinstance(results["goal_met"], bool) and (results["why"] is None) == results["goal_met"]
    assert "convert" in done.stdout and "largest shard" in done.stdout


def test_planned_tower_buckets_pad_the_simulated_packs_less_than_the_grid(tmp_path):
    from benchmarks import bench_tower_buckets

    results = bench_tower_buckets.run(tmp_path, quick=True)
    assert json.loads((tmp_path / "bench_tower_buckets.json").read_text()) == results
    for row in results["per_seq_length"].values():
        assert len(row["planned_sizes"]) <= 16 and row["planned_sizes"][-1] >= row["rows_min_median_max"][2]
        assert row["planned_padding_share"] < row["grid_padding_share"]
        assert row["grid_graphs_by_slots"] >= row["grid_sizes"]  # slot counts only split the grid's sizes
        assert row["flash_programs_bucket_over_longest"] > 1  # the longest image is shorter than the bucket
        by_sizes = list(row["planned_padding_by_sizes"].values())  # 4, 5, 8, 16 sizes: fewer rows each time
        assert by_sizes == sorted(by_sizes, reverse=True) and by_sizes[-1] == row["planned_padding_share"]
        run = row["bench_train_run"]  # a short run plans fewer sizes, so more of its calls replay
        assert run["planned_sizes"] < 16 and run["replayed_share"]["planned"] > run["replayed_share"]["16 planned"]
    assert [c["met"] for c in results["checks"]] == [True, True]
