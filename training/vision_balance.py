"""The vision tower's work spread over the first pipeline stage's data- x tensor-parallel grid, each image once.

Megatron-Bridge's Qwen2-VL / Qwen2.5-VL copy the HF vision tower whole onto every tensor-parallel (TP) rank, and
every TP rank of a data-parallel (DP) replica encodes all of the replica's images: at TP=8 the vision work is done
8 times. Meanwhile DP replicas that hold equal token counts can hold very unequal image work (OrchMLLM, arXiv
2503.23830). Here, as in disaggregated hybrid parallelism (DHP), the tower runs data-parallel over the whole
DP x TP grid of the first stage while the language model keeps its TP / PP / DP / SP layout:

1. every rank learns every rank's image grids and replica (two all_gathers); all ranks compute the same plan:
   each replica's images are first spread over its own TP ranks (costliest first onto the least loaded; all of
   them hold the pixels, so this moves nothing), then whatever keeps a rank above the grid's mean load is dealt,
   costliest first, onto the least loaded rank of the grid (`assign_images`);
2. pixels that leave their replica move with one all_to_all, from the image's `home` rank (the TP rank of the
   replica it was spread to);
3. each rank encodes its images in one tower call;
4. one differentiable all_to_all sends every embedding to all TP ranks of its replica, which scatter them into
   the decoder input as the model would.

Backward. Megatron keeps the decoder input's gradient identical on the TP ranks of a replica (the TP region's
backward all-reduces it; with sequence parallelism the scatter's backward all-gathers it), so the return trip
takes each embedding's gradient from one copy only, the one at its `home` rank, and the encoder gets it once.
Each rank's tower gradient is then its share of the replica's; Megatron-Bridge marks the replicated tower's
parameters `average_gradients_across_tp_domain`, so `finalize_model_grads` AVERAGES them over TP. The return
trip therefore scales the gradient it hands the encoder by `grad_scale` (TP for those towers): a DP sum and a TP
average of TP x the partial gradients is the full gradient on every rank, and multiplying by a power of two is
exact in floating point, so no upstream code is patched. With TP=1 this is the DP-only balancer.

The result equals the replicated path image by image as long as the encoder's output for one image does not
depend on which images share its call. The HF Qwen-VL towers attend per image (`cu_seqlens`), so that holds,
with one CPU exception found by the tests: a linear layer over a single row takes a GEMV kernel whose rounding
differs from the GEMM used for more rows; a lone image of 2 x 2 patches (one merged token) would hit it, but the
Qwen-VL processors never make images under 4 x 4 patches. GPU GEMM kernels may also be chosen by row count, so on
GPU expect equality to within rounding rather than bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from qvl.foundation.cost import VisionShape, vision_flops_per_image

logger = logging.getLogger(__name__)
VisionFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, slots=True, frozen=True)
class VisionAssignment:
    """Where each image of the grid's micro-batches is encoded; images listed replica by replica, in local order."""

    replica: np.ndarray  # int64 [n_images]: the data-parallel replica whose micro-batch holds the image
    home: np.ndarray  # int64 [n_images]: the replica's rank that sends its pixels out and its gradient back
    dest: np.ndarray  # int64 [n_images]: the rank that encodes it
    cost: np.ndarray  # float64 [n_images]: vision forward FLOPs
    members: tuple[tuple[int, ...], ...]  # replica -> its ranks in the group (its TP ranks)

    @property
    def world_size(self) -> int:
        return sum(len(m) for m in self.members)

    def replica_of_rank(self) -> np.ndarray:
        """Replica of each group rank."""
        out = np.empty(self.world_size, dtype=np.int64)
        for replica, ranks in enumerate(self.members):
            out[list(ranks)] = replica
        return out

    def cost_before(self) -> np.ndarray:
        """Vision FLOPs per rank with the tower replicated: every rank encodes all of its replica's images."""
        per_replica = np.bincount(self.replica, weights=self.cost, minlength=len(self.members))
        return per_replica[self.replica_of_rank()]

    def cost_after(self) -> np.ndarray:
        """Vision FLOPs per rank with this assignment."""
        return np.bincount(self.dest, weights=self.cost, minlength=self.world_size)

    def encoded(self) -> np.ndarray:
        """Images each rank encodes."""
        return np.bincount(self.dest, minlength=self.world_size)

    def moved(self) -> int:
        """Images encoded outside their replica (their pixels cross replicas)."""
        return int((self.replica_of_rank()[self.dest] != self.replica).sum())


def assign_images(cost: np.ndarray, owner: np.ndarray, world_size: int) -> np.ndarray:
    """Destination rank per image: keep what fits under the mean load at home, spread the rest largest first.

    Each rank keeps its images, costliest first, while its load stays within the mean (total / world_size); the
    rest go to a pool, which is dealt costliest first onto the least loaded rank (ties: the image's home, then
    the lowest rank). So a balanced batch moves nothing and a skewed one moves only its excess. Deterministic
    (a pure function of the gathered grids), so every rank computes the same assignment. With at least
    `world_size` images every rank encodes at least one.
    """
    cost = np.asarray(cost, dtype=np.float64)
    owner = np.asarray(owner, dtype=np.int64)
    dest = owner.copy()
    target = cost.sum() / world_size * (1 + 1e-9)
    load = np.zeros(world_size)
    pool = []
    for image in _costliest_first(cost):
        home = int(owner[image])
        if load[home] + cost[image] <= target:
            load[home] += cost[image]
        else:
            pool.append(image)
    for image in pool:
        rank, home = int(np.argmin(load)), int(owner[image])
        if load[home] <= load[rank]:
            rank = home  # an equally light home rank saves moving the image
        dest[image] = rank
        load[rank] += cost[image]
    return _give_every_rank_an_image(dest, cost, world_size)


def _costliest_first(cost: np.ndarray) -> list[int]:
    return np.lexsort((np.arange(len(cost)), -cost)).tolist()  # ties by position


def spread_within_replicas(cost: np.ndarray, replica: np.ndarray, members: Sequence[Sequence[int]]) -> np.ndarray:
    """Home rank per image: each replica's images dealt costliest first onto the least loaded of its own ranks.

    All ranks of a replica hold its pixels, so this split moves nothing; `assign_images` then evens out the grid.
    """
    cost, replica = np.asarray(cost, dtype=np.float64), np.asarray(replica, dtype=np.int64)
    home = np.empty(len(cost), dtype=np.int64)
    for index, ranks in enumerate(members):
        images = np.flatnonzero(replica == index)
        load = np.zeros(len(ranks))
        for image in images[_costliest_first(cost[images])]:
            slot = int(np.argmin(load))
            home[image] = ranks[slot]
            load[slot] += cost[image]
    return home


def plan_vision_balance(
    grids_per_replica: Sequence[np.ndarray], shape: VisionShape, members: Sequence[Sequence[int]] | None = None
) -> VisionAssignment:
    """The assignment for the images of every replica (`grids_per_replica[d]` is replica d's `grid_thw` [n_d, 3]).

    `members[d]` lists replica d's ranks in the group (its TP ranks); by default every rank is its own replica
    (data parallelism alone, TP=1).
    """
    grids = [np.asarray(g, dtype=np.int64).reshape(-1, 3) for g in grids_per_replica]
    members = tuple(tuple(int(r) for r in m) for m in (members or [(d,) for d in range(len(grids))]))
    replica = np.repeat(np.arange(len(grids)), [len(g) for g in grids])
    all_grids = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
    cost = vision_flops_per_image(shape, all_grids)
    home = spread_within_replicas(cost, replica, members)
    world = sum(len(m) for m in members)
    return VisionAssignment(
        replica=replica, home=home, dest=assign_images(cost, home, world), cost=cost, members=members
    )


def _give_every_rank_an_image(dest: np.ndarray, cost: np.ndarray, world_size: int) -> np.ndarray:
    """With at least one image per rank, move the cheapest image of the busiest rank to each idle rank.

    A rank that encodes nothing would not know the tower's output width and dtype for the return trip, and its
    tower would not be in the graph whose backward is collective.
    """
    if len(dest) < world_size:
        return dest
    counts = np.bincount(dest, minlength=world_size)
    for idle in np.flatnonzero(counts == 0).tolist():
        busiest = int(np.argmax(counts))
        candidates = np.flatnonzero(dest == busiest)
        image = candidates[np.argmin(cost[candidates])]
        dest[image] = idle
        counts[busiest] -= 1
        counts[idle] += 1
    return dest


# --- routes: which rows go where (numpy, the same on every rank) ----------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class Routes:
    """One rank's part of a plan: row indices and per-rank counts for the three all_to_alls."""

    local_pixel_rows: np.ndarray  # my pixel rows I encode myself (images of my replica given to me), in order
    pixel_send_rows: np.ndarray  # my pixel rows sent out, grouped by destination rank
    pixel_send: list[int]  # patches sent to each rank
    pixel_recv: list[int]  # patches received from each rank
    encode_order: np.ndarray  # global image ids in the order my tower sees them
    fan_send_rows: np.ndarray  # rows of my tower output sent out, grouped by destination rank (repeats per TP rank)
    fan_send: list[int]
    fan_recv: list[int]
    fan_order: np.ndarray  # row of the received embeddings for each row of my replica, in local order
    back_send_rows: np.ndarray  # rows of the received embeddings whose gradient I carry back (I am their home)
    back_send: list[int]
    back_recv: list[int]
    back_recv_rows: np.ndarray  # rows of my tower output each returned gradient row belongs to


def _image_rows(images: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenated row ranges [starts[i], starts[i] + sizes[i]) of `images`, in the given order."""
    parts = [np.arange(starts[i], starts[i] + sizes[i]) for i in images.tolist()]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _grouped(images: np.ndarray, key: np.ndarray) -> np.ndarray:
    """`images` (in global order) grouped by `key[image]` ascending, global order kept inside each group."""
    return images[np.argsort(key[images], kind="stable")]


def _counts(images: np.ndarray, key: np.ndarray, sizes: np.ndarray, world: int) -> list[int]:
    return np.bincount(key[images], weights=sizes[images], minlength=world).astype(np.int64).tolist()


def routes_for(plan: VisionAssignment, rank: int, vision_patches: np.ndarray, merge_unit: int) -> Routes:
    """`rank`'s row indices and counts for moving pixels out, embeddings back to every TP rank, gradients home."""
    world, replica_of = plan.world_size, plan.replica_of_rank()
    mine = int(replica_of[rank])
    rows = vision_patches // merge_unit
    crossing = replica_of[plan.dest] != plan.replica  # encoded outside its replica: its pixels must move
    ids = np.arange(len(plan.dest))
    # Pixels: starts of each image's patches in its replica's pixel_values (replica-local order).
    first = np.r_[0, np.cumsum(np.bincount(plan.replica, minlength=len(plan.members)))][plan.replica]
    global_start = np.cumsum(np.r_[0, vision_patches])[:-1]
    patch_start = global_start - global_start[first]
    local = ids[(plan.dest == rank) & ~crossing]
    out = _grouped(ids[(plan.home == rank) & crossing], plan.dest)
    into = _grouped(ids[(plan.dest == rank) & crossing], plan.home)
    encode_order = np.concatenate([local, into])
    # Embeddings: my tower's output rows per image, then to each rank the images of its replica (global order).
    enc_start = np.zeros(len(ids), np.int64)
    enc_start[encode_order] = np.cumsum(np.r_[0, rows[encode_order]])[:-1]
    mine_encoded = np.sort(encode_order)
    fan_images = [mine_encoded[plan.replica[mine_encoded] == replica_of[r]] for r in range(world)]
    fan_send_rows = np.concatenate([_image_rows(f, enc_start, rows) for f in fan_images] + [np.zeros(0, np.int64)])
    replica_images = ids[plan.replica == mine]
    received = _grouped(replica_images, plan.dest)  # the order they arrive in: by encoding rank
    recv_start = np.zeros(len(ids), np.int64)
    recv_start[received] = np.cumsum(np.r_[0, rows[received]])[:-1]
    carried = received[plan.home[received] == rank]
    returned = _grouped(ids[plan.dest == rank], plan.home)
    return Routes(
        local_pixel_rows=_image_rows(local, patch_start, vision_patches),
        pixel_send_rows=_image_rows(out, patch_start, vision_patches),
        pixel_send=_counts(out, plan.dest, vision_patches, world),
        pixel_recv=_counts(into, plan.home, vision_patches, world),
        encode_order=encode_order,
        fan_send_rows=fan_send_rows,
        fan_send=[int(rows[f].sum()) for f in fan_images],
        fan_recv=_counts(replica_images, plan.dest, rows, world),
        fan_order=_image_rows(replica_images, recv_start, rows),
        back_send_rows=_image_rows(carried, recv_start, rows),
        back_send=_counts(carried, plan.dest, rows, world),
        back_recv=_counts(returned, plan.home, rows, world),
        back_recv_rows=_image_rows(returned, enc_start, rows),
    )


def bytes_sent(
    plan: VisionAssignment,
    vision_patches: np.ndarray,
    shape: VisionShape,
    *,
    pixel_bytes: int = 4,
    embed_bytes: int = 2,
) -> np.ndarray:
    """Bytes each rank sends for one micro-batch: pixels out, embeddings to other ranks, gradients home.

    Self-sends are free; `pixel_bytes` is the processors' float32, `embed_bytes` the training dtype (bf16).
    """
    world, merge_unit = plan.world_size, shape.spatial_merge_size**2
    replica_of = plan.replica_of_rank()
    pixel_width = shape.in_channels * shape.temporal_patch_size * shape.patch_size**2 * pixel_bytes
    embed_width = shape.out_hidden_size * embed_bytes
    rows = vision_patches // merge_unit
    crossing = replica_of[plan.dest] != plan.replica
    sent = np.bincount(plan.home[crossing], weights=vision_patches[crossing] * pixel_width, minlength=world).astype(
        float
    )
    # Each embedding goes from its encoder to every TP rank of its replica but the encoder itself.
    copies = np.asarray([len(plan.members[r]) for r in plan.replica]) - (~crossing)
    sent += np.bincount(plan.dest, weights=rows * copies * embed_width, minlength=world)
    back = plan.home != plan.dest
    sent += np.bincount(plan.home[back], weights=rows[back] * embed_width, minlength=world)
    return sent


# --- collectives ------------------------------------------------------------------------------------------------


def _comm_device(group) -> torch.device:
    return (
        torch.device("cpu")
        if dist.get_backend(group) == dist.Backend.GLOO
        else torch.device("cuda", torch.cuda.current_device())
    )


def _gather_grids(grid_thw: torch.Tensor, replica: int, group) -> tuple[list[np.ndarray], list[int]]:
    """Every rank's grid_thw and replica (two all_gathers: replica and count, then grids padded to the longest)."""
    world = dist.get_world_size(group)
    grid = grid_thw.detach().to("cpu", torch.int64).reshape(-1, 3)
    device = _comm_device(group)
    header = torch.tensor([replica, len(grid)], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    replicas, counts = zip(*(h.tolist() for h in headers))
    padded = torch.zeros(max(counts), 3, dtype=torch.int64)
    padded[: len(grid)] = grid
    gathered = [torch.empty(max(counts), 3, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded.to(device), group=group)
    return [g[:n].cpu().numpy() for g, n in zip(gathered, counts)], list(replicas)


def _replicas(grids: list[np.ndarray], replicas: list[int]) -> tuple[list[np.ndarray], list[tuple[int, ...]]]:
    """Per replica (in replica-id order): its grids and its ranks; refuses ranks of one replica that disagree."""
    ids = sorted(set(replicas))
    members = [tuple(r for r, d in enumerate(replicas) if d == replica) for replica in ids]
    for ranks in members:
        for r in ranks[1:]:
            if not np.array_equal(grids[r], grids[ranks[0]]):
                raise ValueError(
                    f"ranks {ranks[0]} and {r} are one data-parallel replica but hold different images "
                    f"({len(grids[ranks[0]])} vs {len(grids[r])}); every tensor-parallel rank of a replica must "
                    "call this with the same micro-batch, and `replica` must be its data-parallel rank"
                )
    return [grids[m[0]] for m in members], members


def _all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Send `send_counts[r]` consecutive rows to rank r, receive `recv_counts[r]` rows from it.

    `all_to_all_single` with split sizes: gloo's list `all_to_all` insists on equal sizes, this does not.
    """
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


def _take(rows: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    return rows[torch.as_tensor(index, dtype=torch.long, device=rows.device)]


class _FanOut(torch.autograd.Function):
    """Encoded rows to every TP rank of their replica; backward: one gradient per row, from its home, x grad_scale."""

    @staticmethod
    def forward(ctx, encoded: torch.Tensor, routes: Routes, grad_scale: float, group) -> torch.Tensor:
        ctx.routes, ctx.grad_scale, ctx.group, ctx.rows = routes, grad_scale, group, encoded.shape[0]
        return _all_to_all_rows(_take(encoded, routes.fan_send_rows), routes.fan_send, routes.fan_recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r = ctx.routes
        returned = _all_to_all_rows(_take(grad, r.back_send_rows), r.back_send, r.back_recv, ctx.group)
        index = torch.as_tensor(r.back_recv_rows, dtype=torch.long, device=grad.device)
        out = grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy(0, index, returned)
        return (out * ctx.grad_scale if ctx.grad_scale != 1 else out), None, None, None


def balanced_vision_forward(
    vision_fn: VisionFn,
    pixel_values: torch.Tensor | None,
    grid_thw: torch.Tensor,
    *,
    shape: VisionShape,
    group: dist.ProcessGroup | None = None,
    replica: int | None = None,
    grad_scale: float = 1.0,
    pixel_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Encode the images of every replica in `group` once, spread by cost; returns this rank's replica's embeddings.

    `replica` is this rank's data-parallel index: ranks that pass the same one (a replica's TP ranks) hold the same
    micro-batch, and each receives all of its embeddings. By default every rank is its own replica (DP only).
    `grad_scale` multiplies the gradient the tower gets: the number of ranks per replica when the all-reduce over
    them that follows AVERAGES the tower's gradients (Megatron-Bridge's replicated HF towers), 1 where it sums.

    `vision_fn(pixel_values, grid_thw) -> [rows, features]` is the tower call (e.g. HF's `visual(...).pooler_output`),
    with each image's rows contiguous and `spatial_merge_size**2` patches per row. Every rank of `group` must call
    this for every micro-batch (it is collective), and must back-propagate through the result, even an empty one
    (e.g. `hidden = hidden + embeddings.sum() * 0`), because the backward is collective too. With fewer images
    than ranks nothing moves: each rank encodes its replica's images, and one with none gets None. A rank without
    images passes `pixel_values=None`; `pixel_dtype` must then be the dtype the other ranks send.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grids, replicas = _gather_grids(grid_thw, rank if replica is None else replica, group)
    replica_grids, members = _replicas(grids, replicas)
    plan = plan_vision_balance(replica_grids, shape, members)
    if len(plan.cost) < world:
        return vision_fn(pixel_values, grid_thw) if len(grids[rank]) else None
    if rank == 0:
        logger.debug(
            "vision balance: %d images moved of %d; vision FLOPs per rank %s -> %s; images encoded per rank %s",
            plan.moved(),
            len(plan.cost),
            _flops(plan.cost_before()),
            _flops(plan.cost_after()),
            plan.encoded().tolist(),
        )
    all_grids = np.concatenate(replica_grids)
    routes = routes_for(plan, rank, all_grids.prod(axis=1), shape.spatial_merge_size**2)
    if pixel_values is None:  # no images here, but this rank may encode others': an empty tensor to send from
        width = shape.in_channels * shape.temporal_patch_size * shape.patch_size**2
        pixel_values = torch.empty(0, width, dtype=pixel_dtype, device=grid_thw.device)
    received = _all_to_all_rows(
        _take(pixel_values, routes.pixel_send_rows), routes.pixel_send, routes.pixel_recv, group
    )
    pixels = torch.cat([_take(pixel_values, routes.local_pixel_rows), received])
    grid = torch.as_tensor(all_grids[routes.encode_order], dtype=grid_thw.dtype, device=grid_thw.device)
    logger.debug("vision balance rank %d: encoding %d images", rank, len(grid))
    encoded = vision_fn(pixels, grid)
    _check_rows(encoded, grid, shape.spatial_merge_size**2)
    return _take(_FanOut.apply(encoded, routes, float(grad_scale), group), routes.fan_order)


def _flops(per_rank: np.ndarray) -> str:
    return "[" + ", ".join(f"{c:.3g}" for c in per_rank) + "]"


def _check_rows(encoded: torch.Tensor, grid: torch.Tensor, merge_unit: int) -> None:
    vision_patches = int(grid.prod(dim=1).sum())
    if encoded.shape[0] * merge_unit != vision_patches:
        raise ValueError(
            f"vision_fn returned {encoded.shape[0]} rows for {vision_patches} patches; it must return one row per "
            f"{merge_unit} patches (the spatial merge unit), images in input order"
        )
