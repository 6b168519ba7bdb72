"""Vision work over the DP x TP grid: the assignment, its routes (simulated), and two gloo processes encoding a
skewed batch (two DP replicas) and one shared batch (one replica of two TP ranks) bit-exactly, with the tower's
gradients of the replicated run and each image encoded once."""

from __future__ import annotations

import json
import os
import pathlib
import socket

import numpy as np
import pytest
import torch

from qvl.foundation.cost import VisionShape
from qvl.foundation.distributed import start_ranks
from qvl.training.vision_balance import assign_images, bytes_sent, plan_vision_balance, routes_for

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


def test_grid_encodes_each_image_once_and_evens_out_one_replicas_batch():
    # TP=4 x DP=2, and replica 1 holds every image: the replicated tower would encode them on its 4 ranks each.
    rng = np.random.default_rng(1)
    grids = np.c_[np.ones(24, np.int64), rng.integers(2, 7, size=(24, 2)) * 4]  # 8 x 8 to 24 x 24 patches
    plan = plan_vision_balance([np.zeros((0, 3)), grids], SHAPE, members=[(0, 2, 4, 6), (1, 3, 5, 7)])
    before, after = plan.cost_before(), plan.cost_after()
    assert plan.encoded().sum() == 24 and plan.encoded().min() >= 1
    assert before.sum() == pytest.approx(4 * after.sum())  # each image once instead of on 4 TP ranks
    assert after.max() / after.mean() <= 1.15, after / after.mean()
    assert set(plan.home.tolist()) <= {1, 3, 5, 7}  # the split inside the replica moves no pixels


def _simulate(plan, patches: np.ndarray, merge_unit: int, scale: float):
    """Run every rank's routes in numpy: what each rank's tower sees, what it gets back, and the gradients its tower
    gets when every rank's decoder gradient for an embedding row is (image id, row) and the same on all its copies."""
    world, replica_of = plan.world_size, plan.replica_of_rank()
    routes = [routes_for(plan, r, patches, merge_unit) for r in range(world)]
    image_of_patch = np.repeat(np.arange(len(patches)), patches)
    first = {d: np.flatnonzero(plan.replica == d) for d in range(len(plan.members))}
    pixels = [image_of_patch[np.isin(image_of_patch, first[replica_of[r]])] for r in range(world)]

    def all_to_all(send, sends, recvs):  # send[r] rows grouped by destination; sends[r][p] rows r -> p
        offsets = [np.r_[0, np.cumsum(c)] for c in sends]
        return [
            np.concatenate([send[q][offsets[q][r] : offsets[q][r + 1]] for q in range(world)]) for r in range(world)
        ]

    moved = all_to_all([pixels[r][routes[r].pixel_send_rows] for r in range(world)], [x.pixel_send for x in routes],
                       [x.pixel_recv for x in routes])  # fmt: skip
    seen = [np.concatenate([pixels[r][routes[r].local_pixel_rows], moved[r]]) for r in range(world)]
    encoded = [s[::merge_unit] for s in seen]  # one row per merge unit, labelled by its image
    fanned = all_to_all([e[x.fan_send_rows] for e, x in zip(encoded, routes)], [x.fan_send for x in routes],
                        [x.fan_recv for x in routes])  # fmt: skip
    embeddings = [f[x.fan_order] for f, x in zip(fanned, routes)]
    grads = [f.astype(float) + 0.5 for f in fanned]  # the decoder's gradient, identical on every copy
    back = all_to_all([g[x.back_send_rows] for g, x in zip(grads, routes)], [x.back_send for x in routes],
                      [x.back_recv for x in routes])  # fmt: skip
    tower_grads = []
    for r, x in enumerate(routes):
        g = np.zeros(len(encoded[r]))
        np.add.at(g, x.back_recv_rows, back[r])
        tower_grads.append(g * scale)
    return seen, encoded, embeddings, tower_grads


def test_routes_deliver_every_embedding_to_its_replicas_ranks_and_one_gradient_to_its_encoder():
    rng = np.random.default_rng(2)
    members = [(0, 1), (2, 3), (4, 5)]  # DP=3 x TP=2
    grids = [rng.integers(1, 5, size=(n, 3)) * np.array([1, 4, 4]) for n in (7, 0, 3)]
    plan = plan_vision_balance(grids, SHAPE, members)
    patches = np.concatenate(grids).prod(axis=1)
    seen, encoded, embeddings, tower_grads = _simulate(plan, patches, 4, scale=2.0)
    image_of_row = np.repeat(np.arange(len(patches)), patches // 4)
    for r in range(6):
        # The tower gets whole images (all their patches, contiguous) assigned to it, nothing else.
        assert set(seen[r]) == set(np.flatnonzero(plan.dest == r))
        assert np.array_equal(np.bincount(seen[r], minlength=len(patches))[seen[r]], patches[seen[r]])
        # Every TP rank of a replica gets all of the replica's embedding rows, in local order.
        assert np.array_equal(embeddings[r], image_of_row[plan.replica[image_of_row] == plan.replica_of_rank()[r]])
        # Each encoded row gets exactly one gradient (not one per TP copy), times the TP scale.
        assert np.array_equal(tower_grads[r], 2.0 * (encoded[r] + 0.5))
    assert sum(len(e) for e in encoded) == len(image_of_row)  # each image encoded once


def test_bytes_sent_counts_pixels_out_embeddings_to_other_tp_ranks_and_gradients_home():
    # One replica of 2 TP ranks, two equal images: each rank encodes one, sends it to the other, nothing else.
    plan = plan_vision_balance([np.array([[1, 4, 4], [1, 4, 4]])], SHAPE, members=[(0, 1)])
    sent = bytes_sent(plan, np.array([16, 16]), SHAPE, embed_bytes=2)
    assert plan.encoded().tolist() == [1, 1] and plan.moved() == 0
    assert sent.tolist() == [4 * 48 * 2, 4 * 48 * 2]  # 4 rows of 48 bf16 features each way; pixels stay put


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


def _grads(model, op) -> torch.Tensor:
    """The tower's gradients after the all-reduce training applies: SUM over DP, AVG over TP (Megatron-Bridge)."""
    grads = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])
    torch.distributed.all_reduce(grads, op=op)
    return grads


def run_scenario(rank: int, batch: dict[int, list[list[int]]], tensor_parallel: bool = False) -> dict:
    """Replicated and balanced forward + backward of this rank's images; their outputs, reduced gradients and the
    number of images each tower call got. `tensor_parallel`: both ranks are one replica's TP ranks (same batch)."""
    from qvl.training.vision_balance import balanced_vision_forward

    model = _tower()
    calls = []

    def vision_fn(pixels, grid):
        calls.append(len(grid))
        return model(pixels, grid_thw=grid).pooler_output

    home = 0 if tensor_parallel else rank
    op = torch.distributed.ReduceOp.AVG if tensor_parallel else torch.distributed.ReduceOp.SUM
    grid = torch.tensor(batch[home], dtype=torch.long).reshape(-1, 3)
    pixels = _pixels(batch[home], seed=100 + home)
    weights = torch.randn(int(grid.prod(1).sum()) // 4, 48, generator=torch.Generator().manual_seed(home))
    local = vision_fn(pixels, grid) if len(grid) else torch.zeros(0, 48, requires_grad=True)
    (local * weights).sum().backward()
    local_grads = _grads(model, op)
    model.zero_grad()
    calls.clear()
    balanced = balanced_vision_forward(
        vision_fn, pixels, grid, shape=SHAPE, replica=home, grad_scale=2 if tensor_parallel else 1
    )
    (balanced * weights).sum().backward()  # also on a rank without images: the backward is collective
    balanced_grads = _grads(model, op)
    grids = [np.asarray(batch[r]).reshape(-1, 3) for r in range(1 if tensor_parallel else 2)]
    plan = plan_vision_balance(grids, SHAPE, [(0, 1)] if tensor_parallel else None)
    return {
        "equal": torch.equal(local.detach(), balanced.detach()),
        "rows": list(balanced.shape),
        "max_abs_diff": float((local - balanced).detach().abs().max()) if len(local) else 0.0,
        # Weight gradients sum over rows grouped differently per rank: equal to rounding, not bit for bit.
        "grads_close": float((local_grads - balanced_grads).norm()) <= 1e-5 * float(local_grads.norm()),
        "grad_rel_err": float((local_grads - balanced_grads).norm() / local_grads.norm()),
        "images_encoded": sum(calls),
        "before": plan.cost_before().tolist(),
        "after": plan.cost_after().tolist(),
        "moved": plan.moved(),
    }


SCENARIOS = {"skewed": (SKEWED, False), "no_images": (NO_IMAGES, False), "tp2": (SKEWED, True)}


def two_process_worker(rank: int, port: int, out_dir: str) -> None:
    """Entry of each spawned gloo process: every scenario, results as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {name: run_scenario(rank, batch, tp) for name, (batch, tp) in SCENARIOS.items()}
    finally:
        torch.distributed.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vision_balance")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start_ranks(two_process_worker, (port, str(out)), 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
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


def test_two_tp_ranks_encode_each_image_once_with_the_replicated_embeddings_and_gradients(two_ranks):
    """One replica on two TP ranks: the replicated tower encodes its 4 images on both ranks; the grid encodes each
    once, both ranks still get every embedding bit for bit, and after the TP average that training applies the
    tower's gradients equal the replicated run's (each rank's partial gradient, scaled by TP = 2)."""
    tp = [result["tp2"] for result in two_ranks]
    assert sum(t["images_encoded"] for t in tp) == len(SKEWED[0]) and min(t["images_encoded"] for t in tp) >= 1
    for rank, t in enumerate(tp):
        assert t["equal"] and t["rows"] == [int(np.prod(SKEWED[0], axis=1).sum()) // 4, 48], (rank, t["max_abs_diff"])
        assert t["grads_close"], (rank, t["grad_rel_err"])
    after = np.asarray(tp[0]["after"])
    assert sum(tp[0]["before"]) == pytest.approx(2 * after.sum()) and after.max() / after.mean() <= 1.15, after
