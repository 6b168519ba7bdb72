"""What Qwen3.5's multi-token-prediction (MTP) layer takes at image and video placeholders: the vision features, as
the serving engines feed it, not the placeholder token's embedding, as Megatron-Core does.

The MTP layer at position i reads the main model's state at i and the token at i + 1 (qvl.bridges.mtp_reference).
Megatron-Core's `MultiTokenPredictionLayer._get_embeddings` embeds that token's id, so where token i + 1 is an image
or video placeholder it sees the placeholder's row of the embedding table. vLLM's drafter (`Qwen3_5MTP.embed_input_ids`
called with the request's multimodal embeddings, which the scheduler gathers one position ahead,
`shift_computed_tokens=1`; https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen3_5_mtp.py)
and SGLang feed the merged vision features there, the rows the main model's decoder takes as its input. An MTP head
trained on placeholder embeddings is served on other inputs after every image (tiny checkpoints: MTP logits up to
0.5-0.7 apart, top-1 agreement 87-90%).

`NextTokenInputs` is the embedding the MTP layer calls, with the main decoder input's rows (`main_input`, [s, b, h],
vision merged) wherever the token `depth` ahead is a vision placeholder: text positions are unchanged, bit for bit,
and the vision rows carry their gradient back to the tower and merger. Where the MTP layer is on a later pipeline
stage than the vision tower (pipeline_parallel > 1), `VisionRowsLink` sends the first stage's vision rows to the
last stage in the forward and their gradient back in the backward, on two process groups of their own (one per
direction, so neither waits behind the other or behind the schedule's transfers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def vision_positions(input_ids: torch.Tensor, vision_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, sequence) indices of the vision placeholders of `input_ids` [b, s], in row-major order."""
    found = torch.isin(input_ids, torch.tensor(list(vision_token_ids), device=input_ids.device))
    batch, sequence = found.nonzero(as_tuple=True)
    return batch, sequence


class NextTokenInputs:
    """The MTP layer's `embedding(input_ids, position_ids)` for ids `depth` tokens ahead: the embedding's rows, and
    `main_input`'s [s, b, h] (whole, not split over sequence-parallel ranks) where those ids are vision placeholders."""

    def __init__(
        self,
        embedding: Callable,
        main_input: torch.Tensor,
        *,
        depth: int,
        vision_token_ids: Sequence[int],
        sequence_parallel_group: dist.ProcessGroup | None,
    ):
        self.embedding, self.main_input, self.depth = embedding, main_input, depth
        self.vision_token_ids, self.group = tuple(vision_token_ids), sequence_parallel_group

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h] (split with SP)
        # `input_ids` are the main ones `depth` ahead inside each sample (0 past a sample's end, never a vision id),
        # so where they are a vision placeholder the main input `depth` rows on is that placeholder's row
        ahead = torch.roll(self.main_input, shifts=-self.depth, dims=0)
        vision = torch.isin(input_ids, torch.tensor(self.vision_token_ids, device=input_ids.device)).t()  # [s, b]
        if self.group is not None:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            ahead = scatter_to_sequence_parallel_region(ahead, group=self.group)  # backward: all-gather
            rows = ahead.shape[0]
            vision = vision[self.group.rank() * rows : (self.group.rank() + 1) * rows]
        return torch.where(vision.unsqueeze(-1), ahead.to(embedded.dtype), embedded)


@dataclass(kw_only=True, slots=True)
class VisionRowsLink:
    """The first pipeline stage's vision rows to the last stage (the MTP layer's) and their gradient back."""

    peer: int  # the global rank of the other end: the last stage's on the first stage, and the reverse
    forward_group: dist.ProcessGroup  # rows, first -> last
    backward_group: dist.ProcessGroup  # their gradient, last -> first
    pending: list = field(default_factory=list)  # unfinished sends, kept until they complete

    def __reduce__(self):
        """A live connection does not travel: pickled, or copied deeply, it arrives as None (the model provider holds
        the link between its pipeline stages' builds, and Megatron-Bridge's conversions broadcast the provider)."""
        return _no_link, ()

    def _isend(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.pending = [work for work in self.pending if not work.is_completed()]
        self.pending.append(dist.isend(tensor.contiguous(), dst=self.peer, group=group))

    def wait(self) -> None:
        """Until every send so far has been received (sends do not wait: the first stage's forward sends before the
        schedule passes its activations on, so a waiting send would never be received)."""
        for work in self.pending:
            work.wait()
        self.pending = []

    def _recv(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        dist.recv(tensor, src=self.peer, group=group)
        return tensor

    def send(
        self,
        decoder_input: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        dtype: torch.dtype,
        vision_token_ids: Sequence[int],
        sequence_parallel_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """On the first stage: `decoder_input` [s(/tp), b, h] as it is, its vision rows sent to the last stage in
        `dtype` (and their gradient, if they have one, added back in the backward)."""
        positions = vision_positions(input_ids, vision_token_ids)
        return _SendRows.apply(decoder_input, self, positions, sequence_parallel_group, dtype)

    def receive(self, input_ids: torch.Tensor, like: torch.Tensor, vision_token_ids: Sequence[int]) -> torch.Tensor:
        """On the last stage: a [s, b, h] tensor with the first stage's vision rows at the placeholders of
        `input_ids` [b, s] (zeros elsewhere); differentiable, its gradient sent back to the first stage."""
        batch, sequence = vision_positions(input_ids, vision_token_ids)
        full = torch.zeros(input_ids.shape[1], input_ids.shape[0], like.shape[-1], dtype=like.dtype, device=like.device)
        if len(batch) == 0:
            return full
        flag = self._recv(torch.zeros(1, dtype=torch.int64, device=like.device), self.forward_group)
        rows = self._recv(full.new_empty(len(batch), like.shape[-1]), self.forward_group)
        if flag.item():
            rows = _ReturnGradient.apply(rows.requires_grad_(), self)
        return full.index_put((sequence, batch), rows)


def _no_link() -> None:
    return None


class _SendRows(torch.autograd.Function):
    """Identity on the first stage's decoder input; sends its vision rows (gathered whole over sequence-parallel
    ranks) forward and adds the gradient the last stage sends back for them."""

    @staticmethod
    def forward(ctx, decoder_input, link: VisionRowsLink, positions, sequence_parallel_group, dtype):
        batch, sequence = positions
        ctx.link, ctx.positions, ctx.group, ctx.wants = link, positions, sequence_parallel_group, False
        if len(batch) == 0:
            return decoder_input.clone()
        whole = decoder_input
        if ctx.group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            whole = gather_from_sequence_parallel_region(decoder_input, group=ctx.group)
        ctx.wants = ctx.needs_input_grad[0]  # the last stage sends a gradient back only then
        link._isend(torch.tensor([int(ctx.wants)], device=decoder_input.device), link.forward_group)
        link._isend(whole[sequence, batch].to(dtype), link.forward_group)
        ctx.rows, ctx.dtype = len(batch), dtype
        return decoder_input.clone()

    @staticmethod
    def backward(ctx, grad):
        if not ctx.wants:
            return grad, None, None, None, None
        batch, sequence = ctx.positions
        rows = ctx.link._recv(grad.new_empty(ctx.rows, grad.shape[-1], dtype=ctx.dtype), ctx.link.backward_group)
        if ctx.group is not None:  # this rank's slice of the sequence
            start = ctx.group.rank() * grad.shape[0]
            mine = (sequence >= start) & (sequence < start + grad.shape[0])
            batch, sequence, rows = batch[mine], sequence[mine] - start, rows[mine]
        return grad.index_put((sequence, batch), rows.to(grad.dtype), accumulate=True), None, None, None, None


class _ReturnGradient(torch.autograd.Function):
    """Identity on the last stage's received vision rows; sends their gradient back to the first stage."""

    @staticmethod
    def forward(ctx, rows, link: VisionRowsLink):
        ctx.link = link
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.link._isend(grad, ctx.link.backward_group)
        return None, None


def vision_rows_link(pp_group: dist.ProcessGroup) -> VisionRowsLink | None:
    """The link between the first and the last rank of the pipeline group `pp_group`, or None on a rank between them.

    Every rank of the job calls this at the same point (once per model build): the two groups of every pipeline's
    ends are made there by all ranks, in one order, as Megatron-Core makes its groups. A group made by its two members
    alone (`use_local_synchronization`) is named from what each member made before, and torch 2.11 counts the groups a
    rank belongs to, which differ between pipeline stages after Megatron-Core's groups: the two ends waited for each
    other forever (Qwen3.5-VL with MTP at pipeline_parallel=2). A message each way then creates the communicators
    before any forward, where a first use would wait for the other stage."""
    ranks = dist.get_process_group_ranks(pp_group)
    ends = (ranks[0], ranks[-1])
    every_ends: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_ends, ends)
    groups = {pair: (dist.new_group(list(pair)), dist.new_group(list(pair))) for pair in sorted(set(every_ends))}
    if dist.get_rank() not in ends:
        return None
    first = dist.get_rank() == ends[0]
    forward_group, backward_group = groups[ends]
    link = VisionRowsLink(
        peer=ends[1] if first else ends[0], forward_group=forward_group, backward_group=backward_group
    )
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" else "cpu"
    token = torch.zeros(1, device=device)
    for group, sends in ((forward_group, first), (backward_group, not first)):
        dist.send(token, dst=link.peer, group=group) if sends else dist.recv(token, src=link.peer, group=group)
    return link
