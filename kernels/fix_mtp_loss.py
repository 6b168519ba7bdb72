"""The multi-token-prediction (MTP) rows handed to the caller instead of Megatron-Core's own MTP loss (patch group
"fix-mtp-loss" of qvl.foundation.patches).

Megatron-Core 0.19.2's `GPTModel._postprocess` (megatron/core/models/gpt/gpt_model.py ~686-716) passes the decoder
output, with each MTP depth's states concatenated after the main ones along the sequence, to `process_mtp_loss`
(megatron/core/transformer/multi_token_prediction.py ~763), which computes the MTP loss inside the model and hides
it in the backward (`MTPLossAutoScaler`). That function:
- weights MTP tokens per micro-batch: by 1 / (the micro-batch's MTP token count), or with per-token losses by
  (its main-loss count / its MTP count), so a token of a short micro-batch weighs more than one of a long one,
  unlike the main loss, which is token-weighted across micro-batches, data-parallel ranks and packs (the
  averaging ms-swift's users reported, modelscope/ms-swift#10057);
- logs a per-micro-batch mean through a process-wide tracker (`MTPLossLoggingHelper`), averaged again over ranks;
- reads every packed sub-sequence's bounds back to the host (`_roll_tensor_packed_seq`, twice per micro-batch).

While this group is applied, `process_mtp_loss` returns the states as they are, every depth included: the model's
output layer then sees them all. qvl's step passes the model an output processor that computes each depth's
per-token losses beside the main ones (qvl.training.mtp), and its loss function weighs and logs them like the
main loss; `qvl convert verify` reads the MTP logits after the main ones. The MTP layers themselves (projection,
decoder layer, norm) are Megatron-Core's; their next-token input is qvl's MTP layer's (the vision features at image
and video placeholders, as served: qvl.bridges.mtp_inputs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GROUP = "fix-mtp-loss"


def keep_mtp_states(original: Callable) -> Callable:
    """Replacement factory for `gpt_model.process_mtp_loss`: the states unchanged, MTP depths included."""

    def process_mtp_loss(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states

    return process_mtp_loss
