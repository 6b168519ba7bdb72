"""The data benchmark's quick mode runs, writes its JSON only into out_dir and meets the packing goals."""

from __future__ import annotations

import json

from benchmarks import bench_data


def test_quick_benchmark_meets_packing_goals(tmp_path):
    results = bench_data.run(tmp_path, quick=True)
    assert [p.name for p in tmp_path.iterdir()] == ["bench_data.json"]
    assert json.loads((tmp_path / "bench_data.json").read_text()) == json.loads(json.dumps(results))
    by_length = {row["seq_length"]: row for row in results["packing_efficiency"]}
    assert by_length[8192]["qvl_best_fit_decreasing"] >= 0.995
    for row in by_length.values():
        assert row["qvl_best_fit_decreasing"] > row["online_next_fit"] > row["naive_padding"]
    assert results["shard_writing"]["relative_to_plain_tar"] > 0
