"""The DP-aware schedule: shape, determinism, balance goals, and `prepare --data-parallel` through to the loader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qvl.data.balance import (
    imbalance,
    plan_dp_balanced,
    plan_random,
    plan_round_robin,
    reorder,
    schedule_order,
)


def _costs(n: int, seed: int = 0) -> np.ndarray:
    # Pack costs of a LLaVA-like mix spread about as much as real ones (see benchmarks/bench_balance.py).
    return np.random.default_rng(seed).lognormal(0.0, 0.35, n)


def test_every_rank_gets_its_share_of_every_step_and_the_rest_waits():
    cost = _costs(8 * 4 * 10 + 5)
    plan = plan_dp_balanced(cost, 8, 32)
    scheduled = plan.step >= 0
    assert (~scheduled).sum() == 5 and plan.n_steps == 10
    cells = plan.step[scheduled] * 8 * 4 + plan.rank[scheduled] * 4 + plan.slot[scheduled]
    assert np.array_equal(np.sort(cells), np.arange(320))  # one pack per (step, rank, slot)
    again = plan_dp_balanced(cost, 8, 32)
    assert all(
        np.array_equal(a, b) for a, b in ((plan.step, again.step), (plan.rank, again.rank), (plan.slot, again.slot))
    )
    assert not np.array_equal(plan.step, plan_dp_balanced(cost, 8, 32, seed=1).step)  # seed shuffles step order


@pytest.mark.parametrize(
    ("data_parallel", "per_rank", "goal"), [(8, 16, 1.02), (32, 16, 1.02), (8, 4, 1.10), (32, 4, 1.10)]
)
def test_balance_goals(data_parallel, per_rank, goal):
    global_batch_size = data_parallel * per_rank
    cost = _costs(global_batch_size * 20)
    qvl = imbalance(plan_dp_balanced(cost, data_parallel, global_batch_size), cost)
    shuffled = imbalance(plan_random(len(cost), data_parallel, global_batch_size), cost)
    assert qvl["time_over_ideal"] <= goal, qvl
    assert qvl["time_over_ideal"] < 1 + (shuffled["time_over_ideal"] - 1) / 4, (qvl, shuffled)


def test_round_robin_and_serving_order():
    plan = plan_round_robin(10, 2, 4)
    assert plan.step.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]
    assert plan.rank.tolist()[:8] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert plan.packs_of_rank(1).tolist() == [1, 3, 5, 7]
    ordered = reorder(plan, schedule_order(plan))
    assert ordered.rank.tolist()[:8] == [0, 0, 1, 1, 0, 0, 1, 1] and ordered.step.tolist()[-2:] == [-1, -1]


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="multiple of --data-parallel"):
        plan_dp_balanced(_costs(10), 3, 4)


# --- prepare --data-parallel and the planned loader -----------------------------------------------------------

TINY_CONFIG = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1024,
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
}


@pytest.fixture(scope="module")
def planned(synthetic_dataset, hf_paths, tmp_path_factory):
    from qvl.data.prepare import PrepareConfig, prepare

    input_path, media_root, _, good = synthetic_dataset
    root = tmp_path_factory.mktemp("planned")
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    config = PrepareConfig(
        input=input_path,
        media_root=media_root,
        family="qwen2_5_vl",
        hf_path=hf_paths["qwen2_5_vl"],
        seq_length=256,
        output=root / "ds",
        packs_per_shard=2,
        data_parallel=2,
        global_batch_size=4,
        model_config=root / "config.json",
    )
    report = prepare(config)
    packs = [json.loads(line) for line in (root / "ds" / "packs.jsonl").read_text().splitlines()]
    return root / "ds", report, packs, good


def test_packs_carry_cost_step_rank_and_the_report_compares_round_robin(planned):
    _, report, packs, good = planned
    plan = report["dp_plan"]
    assert plan["steps"] >= 1 and plan["data_parallel"] == 2 and plan["packs_per_rank_per_step"] == 2
    assert all({"cost", "step", "rank", "slot"} <= set(p) and p["cost"] > 0 for p in packs)
    assert sorted(i for p in packs for i in p["samples"]) == good  # reordering kept every sample once
    scheduled = [p for p in packs if p["step"] >= 0]
    assert len(scheduled) == plan["steps"] * 4 and plan["unscheduled_packs"] == len(packs) - len(scheduled)
    assert [(p["step"], p["rank"], p["slot"]) for p in scheduled] == sorted(
        (p["step"], p["rank"], p["slot"]) for p in scheduled
    )
    loads = np.zeros((plan["steps"], 2))
    for p in scheduled:
        loads[p["step"], p["rank"]] += p["cost"]
    assert plan["qvl"]["mean_max_over_mean"] == pytest.approx((loads.max(1) / loads.mean(1)).mean(), abs=1e-4)
    assert plan["qvl"]["time_over_ideal"] <= plan["round_robin"]["time_over_ideal"]


def test_planned_loader_serves_each_rank_its_packs_in_order_and_resumes(planned, hf_paths):
    from qvl.data.encode import QwenVLPackedTaskEncoder
    from qvl.data.planned import PlannedPackLoader

    output, report, packs, _ = planned
    encoder = QwenVLPackedTaskEncoder(hf_path=hf_paths["qwen2_5_vl"], family="qwen2_5_vl", tokens_per_second=2)
    for rank in range(2):
        mine = [
            p["samples"] for p in sorted((p for p in packs if p["rank"] == rank), key=lambda p: (p["step"], p["slot"]))
        ]
        loader = PlannedPackLoader(output, encoder, rank=rank, data_parallel=2, micro_batch_size=1)
        served = [next(loader).source_indices[0] for _ in range(len(mine))]
        assert served == mine
    loader = PlannedPackLoader(output, encoder, rank=0, data_parallel=2, micro_batch_size=2)
    next(loader)
    state = loader.save_state()
    expected = [next(loader).tokens.tolist() for _ in range(2)]  # runs past the end: wraps to step 0
    resumed = PlannedPackLoader(output, encoder, rank=0, data_parallel=2, micro_batch_size=2)
    resumed.restore_state(state)
    assert [next(resumed).tokens.tolist() for _ in range(2)] == expected


def test_quick_benchmark_meets_balance_goals(tmp_path):
    from benchmarks import bench_balance

    results = bench_balance.run(tmp_path, quick=True)
    assert [p.name for p in tmp_path.iterdir()] == ["bench_balance.json"]
    for row in results["schedules"]:
        assert row["qvl"] <= (1.02 if row["packs_per_rank"] >= 16 else 1.10), row
        assert row["qvl"] < row["random"], row
    online = results["online_vision"]
    assert online["vision_max_over_mean_after"] < online["vision_max_over_mean_before"]
