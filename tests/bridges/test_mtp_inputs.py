"""The MTP layer's next-token inputs (qvl.bridges.mtp_inputs): the main decoder input's rows where the token ahead is
a vision placeholder, the embedding elsewhere; and at pipeline_parallel=2 the first stage's vision rows reach the
last stage and their gradient comes back, micro-batch after micro-batch, with or without a gradient to return; the
link forms where the two stages hold different groups, under torch 2.11's names as under the pinned torch's."""

from __future__ import annotations

import datetime
import functools
import hashlib

import pytest
import torch

from qvl.bridges.mtp_inputs import NextTokenInputs, vision_rows_link
from qvl.foundation.distributed import run_on_ranks
from qvl.kernels.packed_shift import shift_in_sequences

IMAGE, VIDEO = 9, 8
IDS = torch.tensor([[1, IMAGE, IMAGE, 2, VIDEO, 3], [IMAGE, 4, 5, VIDEO, VIDEO, 6]])


def test_next_token_inputs_take_the_vision_rows_ahead_and_the_embedding_elsewhere():
    torch.manual_seed(0)
    table, main = torch.randn(10, 4), torch.randn(6, 2, 4)  # main: [s, b, h], vision rows merged

    def embedding(input_ids, position_ids):
        return torch.nn.functional.embedding(input_ids, table).transpose(0, 1)

    cu = torch.tensor([0, 4, 6])  # one row, two samples: nothing is read across their boundary
    ids = IDS[:1]
    ahead = shift_in_sequences(ids, cu)
    inputs = NextTokenInputs(embedding, main[:, :1], depth=1, vision_token_ids=(IMAGE, VIDEO),
                             sequence_parallel_group=None)(ahead, None)  # fmt: skip
    expected = [main[i + 1, 0] if ahead[0, i] in (IMAGE, VIDEO) else table[ahead[0, i]] for i in range(6)]
    assert torch.equal(inputs[:, 0], torch.stack(expected))
    assert ahead[0].tolist() == [IMAGE, IMAGE, 2, 0, 3, 0]  # the video at 4 starts the second sample: never ahead


def _as_torch_2_11_names_groups() -> None:
    """In this rank: a group its members make alone (`use_local_synchronization`) named as torch 2.11 names it, from
    the number of groups the rank belongs to (the pinned torch counts the groups every rank made), and every group's
    connection given up after a minute (a link made that way would wait for the other stage forever, under other
    names)."""
    from torch.distributed import distributed_c10d

    def hashed(ranks) -> str:
        unique = f"{'_'.join(map(str, ranks))}_{len(distributed_c10d._world.pg_names)}"
        return hashlib.sha1(unique.encode(), usedforsecurity=False).hexdigest()

    distributed_c10d._hash_ranks_to_str = hashed
    torch.distributed.new_group = functools.partial(torch.distributed.new_group, timeout=datetime.timedelta(minutes=1))


def _two_micro_batches() -> list:
    """On each of two pipeline stages: two micro-batches with vision rows, the first with a gradient to send back,
    the second without (an evaluation forward)."""
    from megatron.core import parallel_state

    _as_torch_2_11_names_groups()
    torch.distributed.new_group([0])  # as Megatron-Core makes its groups: every rank calls, the first stage joins
    first = parallel_state.is_pipeline_first_stage()
    link = vision_rows_link(parallel_state.get_pipeline_model_parallel_group())
    found = []
    for step, wants_gradient in enumerate((True, False)):
        torch.manual_seed(step)  # the same tensors on both ranks
        decoder_input, weight = torch.randn(6, 2, 4, requires_grad=wants_gradient), torch.randn(6, 2, 4)
        if first:
            output = link.send(
                decoder_input, IDS, dtype=torch.float32, vision_token_ids=(IMAGE, VIDEO), sequence_parallel_group=None
            )
            if wants_gradient:
                output.sum().backward()  # the next stage's gradient for this stage's output: ones
            found.append(decoder_input.grad)
        else:
            received = link.receive(IDS, decoder_input.detach(), (IMAGE, VIDEO))
            if wants_gradient:
                (received * weight).sum().backward()
            found.append(received.detach())
    link.wait()
    return found


@pytest.mark.slow  # two processes: ~80 s on 2 busy cores where it starts the session's rank server
def test_the_first_stages_vision_rows_reach_the_last_and_their_gradient_returns():
    first, last = run_on_ranks(_two_micro_batches, pipeline_parallel=2, cpu=True)
    vision = torch.isin(IDS, torch.tensor([IMAGE, VIDEO])).t().unsqueeze(-1)  # [s, b, 1]
    for step, received in enumerate(last):
        torch.manual_seed(step)
        decoder_input, weight = torch.randn(6, 2, 4), torch.randn(6, 2, 4)
        assert torch.equal(received, torch.where(vision, decoder_input, 0.0))
        if step == 0:
            assert torch.equal(first[0], 1.0 + torch.where(vision, weight, 0.0))
    assert first[1] is None
