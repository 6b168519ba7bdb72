"""Online post-balancing of the vision encoder across data-parallel ranks (OrchMLLM, arXiv 2503.23830, section 4).

Data-parallel ranks that hold equal token counts can hold very unequal image work, and the slowest rank sets the
step time. Before the vision encoder runs, every rank learns every rank's image grids (one all_gather), all ranks
compute the same assignment of images to ranks (largest vision cost first onto the least loaded rank), pixel
patches move with one all_to_all, each rank encodes the images it was given, and one all_to_all brings every
embedding back to the rank that owns its sample before the language model runs. The return trip is differentiable:
its backward is the reverse all_to_all, so gradients reach the encoder replica that produced each embedding.

The result equals the unbalanced path image by image as long as the encoder's output for one image does not
depend on which images share its call. The HF Qwen-VL towers attend per image (`cu_seqlens`), so that holds,
with one CPU exception found by the tests: a linear layer over a single row takes a GEMV kernel whose rounding
differs from the GEMM used for more rows; a lone image of 2 x 2 patches (one merged token) would hit it, but the
Qwen-VL processors never make images under 4 x 4 patches. GPU GEMM kernels may also be chosen by row count, so on
GPU expect equality to within rounding rather than bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from qvl.data.cost import VisionShape, vision_flops_per_image

logger = logging.getLogger(__name__)
VisionFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, slots=True, frozen=True)
class VisionAssignment:
    """Where each image of the global micro-batch is encoded; images listed rank by rank, in local order."""

    owner: np.ndarray  # int64 [n_images]: the rank whose sample holds the image
    dest: np.ndarray  # int64 [n_images]: the rank that encodes it
    cost: np.ndarray  # float64 [n_images]: vision forward FLOPs
    world_size: int

    def cost_before(self) -> np.ndarray:
        """Vision FLOPs per rank without balancing."""
        return np.bincount(self.owner, weights=self.cost, minlength=self.world_size)

    def cost_after(self) -> np.ndarray:
        """Vision FLOPs per rank with this assignment."""
        return np.bincount(self.dest, weights=self.cost, minlength=self.world_size)

    def moved(self) -> int:
        """Images encoded away from their owner."""
        return int((self.owner != self.dest).sum())


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
    for image in np.lexsort((np.arange(len(cost)), -cost)).tolist():  # costliest first, ties by position
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


def _give_every_rank_an_image(dest: np.ndarray, cost: np.ndarray, world_size: int) -> np.ndarray:
    """With at least one image per rank, move the cheapest image of the busiest rank to each idle rank.

    A rank that encodes nothing would not know the tower's output width for the return trip.
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


def plan_vision_balance(grids_per_rank: list[np.ndarray], shape: VisionShape) -> VisionAssignment:
    """The assignment for the images of every rank (`grids_per_rank[r]` is rank r's `grid_thw` [n_r, 3])."""
    grids = [np.asarray(g, dtype=np.int64).reshape(-1, 3) for g in grids_per_rank]
    owner = np.repeat(np.arange(len(grids)), [len(g) for g in grids])
    all_grids = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
    cost = vision_flops_per_image(shape, all_grids)
    return VisionAssignment(owner=owner, dest=assign_images(cost, owner, len(grids)), cost=cost, world_size=len(grids))


def _gather_grids(grid_thw: torch.Tensor, group) -> list[np.ndarray]:
    """Every rank's grid_thw (two all_gathers: counts, then grids padded to the longest)."""
    world = dist.get_world_size(group)
    grid = grid_thw.detach().to("cpu", torch.int64).reshape(-1, 3)
    device = _comm_device(group)
    count = torch.tensor([len(grid)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    padded = torch.zeros(max(counts), 3, dtype=torch.int64)
    padded[: len(grid)] = grid
    gathered = [torch.empty(max(counts), 3, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded.to(device), group=group)
    return [g[:n].cpu().numpy() for g, n in zip(gathered, counts)]


def _comm_device(group) -> torch.device:
    return (
        torch.device("cpu")
        if dist.get_backend(group) == dist.Backend.GLOO
        else torch.device("cuda", torch.cuda.current_device())
    )


def _all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Send `send_counts[r]` consecutive rows to rank r, receive `recv_counts[r]` rows from it.

    `all_to_all_single` with split sizes: gloo's list `all_to_all` insists on equal sizes, this does not.
    """
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """`_all_to_all_rows` whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _all_to_all_rows(rows, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_counts, recv_counts = ctx.counts
        return _all_to_all_rows(grad, recv_counts, send_counts, ctx.group), None, None, None


def balanced_vision_forward(
    vision_fn: VisionFn,
    pixel_values: torch.Tensor | None,
    grid_thw: torch.Tensor,
    *,
    shape: VisionShape,
    group: dist.ProcessGroup | None = None,
    pixel_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Encode this rank's images with the vision cost balanced over `group`; returns this rank's embeddings.

    `vision_fn(pixel_values, grid_thw) -> [rows, features]` is the tower call (e.g. HF's `visual(...).pooler_output`;
    for Qwen3-VL concatenate the deepstack features along the last dimension and split them after), with each
    image's rows contiguous and proportional to its patches. Every rank of `group` must call this for every
    micro-batch (it is collective), and must back-propagate through the result, even an empty one (e.g.
    `hidden = hidden + embeddings.sum() * 0`), because the backward is collective too. With fewer images than
    ranks nothing moves: each rank encodes its own images, and one with none gets None. A rank without images
    passes `pixel_values=None`; `pixel_dtype` must then be the dtype the other ranks send (the processors' float32).
    """
    grids = _gather_grids(grid_thw, group)
    plan = plan_vision_balance(grids, shape)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if len(plan.cost) < world:
        return vision_fn(pixel_values, grid_thw) if len(grids[rank]) else None
    if rank == 0:
        logger.debug(
            "vision balance: %d images moved of %d; vision FLOPs per rank %s -> %s",
            plan.moved(),
            len(plan.cost),
            _flops(plan.cost_before()),
            _flops(plan.cost_after()),
        )
    patches = [g.prod(axis=1) for g in grids]
    if pixel_values is None:  # no images here, but this rank may encode others': an empty tensor to send from
        width = shape.in_channels * shape.temporal_patch_size * shape.patch_size**2
        pixel_values = torch.empty(0, width, dtype=pixel_dtype, device=grid_thw.device)
    mine = plan.owner == rank
    my_dest = plan.dest[mine]
    # Send: my images grouped by destination, local order kept inside each group.
    send_order = np.argsort(my_dest, kind="stable")
    starts = np.r_[0, np.cumsum(patches[rank])]
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in send_order] + [np.zeros(0, np.int64)])
    send = pixel_values[torch.as_tensor(rows, dtype=torch.long, device=pixel_values.device)]
    send_counts = np.bincount(my_dest, weights=patches[rank], minlength=world).astype(np.int64)
    # Receive: from each source, its images assigned to me, in its local order.
    incoming = [grids[s][plan.dest[plan.owner == s] == rank] for s in range(world)]
    recv_counts = [int(g.prod(axis=1).sum()) for g in incoming]
    received = _all_to_all_rows(send, send_counts.tolist(), recv_counts, group)
    recv_grid = torch.as_tensor(np.concatenate(incoming), dtype=grid_thw.dtype, device=grid_thw.device)
    encoded = vision_fn(received, recv_grid)
    rows_per_patch = _rows_per_patch(encoded, recv_grid)
    back = [int(n) // rows_per_patch for n in send_counts]
    by_dest = _AllToAllRows.apply(encoded, [n // rows_per_patch for n in recv_counts], back, group)
    # by_dest holds my images ordered by (destination, local index); put them back in local order.
    index = _restore_rows(send_order, patches[rank] // rows_per_patch)
    return by_dest[torch.as_tensor(index, device=by_dest.device)]


def _flops(per_rank: np.ndarray) -> str:
    return "[" + ", ".join(f"{c:.3g}" for c in per_rank) + "]"


def _rows_per_patch(encoded: torch.Tensor, grid: torch.Tensor) -> int:
    """Patches per output row (the spatial merge unit), checked against the tower's output."""
    patches = int(grid.prod(dim=1).sum())
    if encoded.shape[0] == 0 or patches % encoded.shape[0]:
        raise ValueError(
            f"vision_fn returned {encoded.shape[0]} rows for {patches} patches; it must return a whole "
            "number of rows per merge unit, images in input order"
        )
    return patches // encoded.shape[0]


def _restore_rows(send_order: np.ndarray, rows_per_image: np.ndarray) -> np.ndarray:
    """Row index into the (destination, local)-ordered embeddings for each row in local image order."""
    if len(send_order) == 0:
        return np.zeros(0, dtype=np.int64)
    sent_rows = rows_per_image[send_order]
    sent_start = np.r_[0, np.cumsum(sent_rows)[:-1]]
    start_of = np.empty(len(send_order), dtype=np.int64)
    start_of[send_order] = sent_start
    return np.concatenate([np.arange(start_of[i], start_of[i] + rows_per_image[i]) for i in range(len(send_order))])
