"""The planned-pack loader: every scheduled pack served exactly once per epoch across the plan's ranks, a DP size or
global batch other than the plan's refused (at start and on resume), and worker processes that prefetch the same
stream the training process would encode itself, resuming at exactly the next micro-batch."""

from __future__ import annotations

import collections

import pytest
import torch

from qvl.foundation.errors import DataError
from tests.data.test_balance import planned  # noqa: F401  (module fixture: a dataset planned for DP=2, G=4)


@pytest.fixture(scope="module")
def encoder(hf_paths):
    from qvl.data.encode import QwenVLPackedTaskEncoder

    return QwenVLPackedTaskEncoder(hf_path=hf_paths["qwen2_5_vl"], family="qwen2_5_vl", tokens_per_second=2)


def _loader(planned, encoder, **kwargs):
    from qvl.data.planned import PlannedPackLoader

    output, report, _, _ = planned
    plan = report["dp_plan"]
    args = dict(
        rank=0, data_parallel=plan["data_parallel"], global_batch_size=plan["global_batch_size"], micro_batch_size=1
    )
    return PlannedPackLoader(output, encoder, **{**args, **kwargs})


def test_an_epoch_serves_every_scheduled_pack_once_over_the_plans_ranks(planned, encoder):
    _, report, packs, _ = planned
    plan = report["dp_plan"]
    per_rank = plan["steps"] * plan["packs_per_rank_per_step"]
    served = collections.Counter()
    for rank in range(plan["data_parallel"]):
        loader = _loader(planned, encoder, rank=rank, micro_batch_size=2)
        for _ in range(per_rank // 2):
            served.update(tuple(s) for s in next(loader).source_indices)
    scheduled = collections.Counter(tuple(p["samples"]) for p in packs if p["step"] >= 0)
    assert served == scheduled and max(served.values()) == 1  # none skipped, none twice


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"data_parallel": 1},
            "planned for data_parallel=2, global_batch_size=4.*--data-parallel 1 --global-batch-size 4",
        ),
        ({"data_parallel": 4, "rank": 3}, "data_parallel=4.*planned for data_parallel=2"),
        ({"global_batch_size": 8}, "global_batch_size=8.*planned for data_parallel=2, global_batch_size=4"),
    ],
    ids=["fewer-ranks", "more-ranks", "other-global-batch"],
)
def test_a_dp_size_or_global_batch_other_than_the_plans_is_refused(planned, encoder, change, message):
    with pytest.raises(DataError, match=message):
        _loader(planned, encoder, **change)


def test_resuming_a_position_saved_at_another_dp_size_is_refused(planned, encoder):
    loader = _loader(planned, encoder)
    next(loader)
    state = loader.save_state()
    assert state == {"position": 1, "micro_batch_size": 1, "data_parallel": 2, "global_batch_size": 4}
    with pytest.raises(DataError, match="checkpoint being resumed was trained at data_parallel=4"):
        _loader(planned, encoder).restore_state({**state, "data_parallel": 4})
    with pytest.raises(DataError, match="micro-batches of 2 packs.*micro_batch_size=2"):
        _loader(planned, encoder).restore_state({**state, "micro_batch_size": 2})


def _same(a, b) -> bool:
    keys = ("tokens", "labels", "position_ids", "cu_seqlens_q", "pixel_values", "image_grid_thw")
    return all(
        (getattr(a, k) is None and getattr(b, k) is None) or torch.equal(getattr(a, k), getattr(b, k)) for k in keys
    )


def test_worker_processes_serve_the_same_stream_and_resume_exactly(planned, encoder):
    one_process = _loader(planned, encoder, micro_batch_size=2)
    expected = [next(one_process) for _ in range(5)]  # past the end of the plan: wraps to step 0
    workers = _loader(planned, encoder, micro_batch_size=2, num_workers=2, prefetch=2)
    first = [next(workers) for _ in range(2)]
    state = workers.save_state()
    workers.close()
    resumed = _loader(planned, encoder, micro_batch_size=2, num_workers=2, prefetch=2)
    resumed.restore_state(state)
    rest = [next(resumed) for _ in range(3)]
    assert all(_same(a, b) for a, b in zip(first + rest, expected, strict=True))


@pytest.mark.slow
def test_training_at_a_dp_size_the_dataset_was_not_planned_for_is_refused(planned, tmp_path):
    """Through `qvl train` (Megatron-Bridge's loop, one process = DP 1) on a dataset planned for DP 2: the packs
    planned for rank 1 would never be served, so the config check refuses before any model is built, naming the re-plan."""
    from tests.run_qvl import qvl_forked

    output, _, _, _ = planned
    args = ["train_iters=1", "global_batch_size=4", "seq_length=256", "--model", "tiny", "--device", "cpu"]
    done = qvl_forked("train", "qwen2_5_vl_3b_pretrain", f"data={output}", *args, "--run-dir", str(tmp_path))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr  # refused where the config is checked, before any model is built
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: this run trains at data_parallel=1, global_batch_size=4")
        and "planned for data_parallel=2" in last
    )
    assert "--data-parallel 1 --global-batch-size 4" in last
