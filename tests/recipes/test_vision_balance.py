"""Online vision post-balancing: the assignment, and two gloo processes encoding a skewed batch bit-exactly."""

from __future__ import annotations

import json
import os
import pathlib
import socket

import numpy as np
import pytest
import torch

from qvl.data.cost import VisionShape
from qvl.recipes.training.vision_balance import assign_images, plan_vision_balance

# A tiny Qwen2.5-VL-like tower: SwiGLU blocks, 56-px windows (2 x 2 merged units), block 1 full attention.
TOWER = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=48,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
)
SHAPE = VisionShape(**{**TOWER, "fullatt_block_indexes": (1,)}, gated_mlp=True)
# Rank 0 holds the large images, rank 1 small ones (all at least 4 x 4 patches, as the processors make them).
SKEWED = {0: [[1, 32, 32], [1, 24, 32], [1, 16, 28], [2, 8, 8]], 1: [[1, 4, 4], [1, 4, 8], [1, 8, 4], [1, 4, 4]]}
NO_IMAGES = {0: [[1, 16, 16], [1, 8, 12], [1, 4, 4]], 1: []}


def test_assignment_is_deterministic_and_balances():
    rng = np.random.default_rng(0)
    cost = rng.lognormal(0.0, 0.7, 400)
    owner = np.repeat(np.arange(8), 50)
    owner_load = np.bincount(owner, weights=np.where(owner == 0, cost * 20, cost))
    dest = assign_images(np.where(owner == 0, cost * 20, cost), owner, 8)
    assert np.array_equal(dest, assign_images(np.where(owner == 0, cost * 20, cost), owner, 8))
    after = np.bincount(dest, weights=np.where(owner == 0, cost * 20, cost), minlength=8)
    assert owner_load.max() / owner_load.mean() > 3
    assert after.max() / after.mean() < 1.05 and np.bincount(dest, minlength=8).min() >= 1


def test_equal_images_stay_home():
    # Already balanced: every rank keeps its own images, so nothing moves.
    dest = assign_images(np.ones(6), np.array([0, 0, 1, 1, 2, 2]), 3)
    assert dest.tolist() == [0, 0, 1, 1, 2, 2]


def test_plan_reports_cost_before_and_after():
    plan = plan_vision_balance([np.array(SKEWED[0]), np.array(SKEWED[1])], SHAPE)
    before, after = plan.cost_before(), plan.cost_after()
    assert before.sum() == pytest.approx(after.sum())
    assert before.max() / before.mean() > 1.9  # rank 0 does almost all of the work
    assert after.max() / after.mean() < before.max() / before.mean()


def _tower(seed: int = 0):
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(**TOWER)).float()


def _pixels(grids: list[list[int]], seed: int) -> torch.Tensor | None:
    if not grids:
        return None
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(np.prod(grids, axis=1).sum()), 3 * 2 * 14 * 14, generator=generator)


def _grads(model) -> torch.Tensor:
    grads = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])
    torch.distributed.all_reduce(grads)
    return grads


def run_scenario(rank: int, batch: dict[int, list[list[int]]]) -> dict:
    """Unbalanced and balanced forward + backward of this rank's images; their outputs and summed gradients."""
    from qvl.recipes.training.vision_balance import balanced_vision_forward

    model = _tower()
    vision_fn = lambda pixels, grid: model(pixels, grid_thw=grid).pooler_output  # noqa: E731
    grid = torch.tensor(batch[rank], dtype=torch.long).reshape(-1, 3)
    pixels = _pixels(batch[rank], seed=100 + rank)
    weights = torch.randn(int(grid.prod(1).sum()) // 4, 48, generator=torch.Generator().manual_seed(rank))
    local = vision_fn(pixels, grid) if len(grid) else torch.zeros(0, 48, requires_grad=True)
    (local * weights).sum().backward()
    local_grads = _grads(model)
    model.zero_grad()
    balanced = balanced_vision_forward(vision_fn, pixels, grid, shape=SHAPE)
    (balanced * weights).sum().backward()  # also on a rank without images: the backward is collective
    balanced_grads = _grads(model)
    plan = plan_vision_balance([np.asarray(batch[r]).reshape(-1, 3) for r in range(2)], SHAPE)
    return {
        "equal": torch.equal(local.detach(), balanced.detach()),
        "rows": list(balanced.shape),
        "max_abs_diff": float((local - balanced).detach().abs().max()) if len(local) else 0.0,
        # Weight gradients sum over rows grouped differently per rank: equal to rounding, not bit for bit.
        "grads_close": float((local_grads - balanced_grads).norm()) <= 1e-5 * float(local_grads.norm()),
        "grad_rel_err": float((local_grads - balanced_grads).norm() / local_grads.norm()),
        "before": plan.cost_before().tolist(),
        "after": plan.cost_after().tolist(),
        "moved": plan.moved(),
    }


def two_process_worker(rank: int, port: int, out_dir: str) -> None:
    """Entry of each spawned gloo process: both scenarios, results as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {name: run_scenario(rank, batch) for name, batch in (("skewed", SKEWED), ("no_images", NO_IMAGES))}
    finally:
        torch.distributed.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vision_balance")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(two_process_worker, args=(port, str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_balanced_embeddings_equal_unbalanced_bit_for_bit(two_ranks):
    for rank, result in enumerate(two_ranks):
        skewed = result["skewed"]
        assert skewed["equal"], (rank, skewed["max_abs_diff"])
        assert skewed["rows"] == [int(np.prod(SKEWED[rank], axis=1).sum()) // 4, 48]
        assert skewed["grads_close"], (rank, skewed["grad_rel_err"])


def test_skewed_vision_cost_is_evened_out(two_ranks):
    skewed = two_ranks[0]["skewed"]
    before, after = np.asarray(skewed["before"]), np.asarray(skewed["after"])
    print(
        f"vision FLOPs per rank before {before.tolist()} (max/mean {before.max() / before.mean():.3f}), "
        f"after {after.tolist()} (max/mean {after.max() / after.mean():.3f}), {skewed['moved']} images moved"
    )
    assert before.max() / before.mean() > 1.9
    assert after.max() / after.mean() < 1.35 and skewed["moved"] >= 1


def test_a_rank_without_images_still_encodes_for_others(two_ranks):
    for rank, result in enumerate(two_ranks):
        no_images = result["no_images"]
        assert no_images["equal"] and no_images["grads_close"]
        assert no_images["after"][1] > 0  # rank 1 had no images but encoded some of rank 0's
