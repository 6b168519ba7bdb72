"""One token to the left inside every packed sub-sequence, without reading the pack's bounds back to the host.

Multi-token prediction looks one token further ahead per depth: its input ids, positions, targets and loss mask
are the main ones shifted left by one, and in a THD pack the shift must stay inside each sample (no position may
see or predict a token of the next one). Megatron-Core's `roll_tensor` does that with a Python loop over
`cu_seqlens` on the host (megatron/core/transformer/multi_token_prediction.py `_roll_tensor_packed_seq`); a roll of
the whole pack and one `index_fill` at the samples' last positions give the same tensor on the device.
"""

from __future__ import annotations

import torch


def shift_in_sequences(tensor: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """`tensor` [..., s] moved one position left inside every packed sub-sequence (`cu_seqlens`, or the whole row),
    the last position of each piece set to zero; no host read of `cu_seqlens`."""
    shifted = torch.roll(tensor, shifts=-1, dims=-1)
    ends = cu_seqlens[1:].long() - 1 if cu_seqlens is not None else torch.tensor([tensor.shape[-1] - 1])
    return shifted.index_fill(-1, ends.to(tensor.device), 0)
