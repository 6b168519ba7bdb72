"""The pad tokens of a padded pack left out of the MoE router's statistics (patch group "fix-moe-pad-tokens" of
qvl.foundation.patches).

Under pipeline parallelism every pack is padded to `seq_length` with one extra sub-sequence of pad tokens, and
under sequence parallelism to a multiple of the TP size (qvl.training.step.padded_length): stages exchange
activations in buffers of one size, and the TP ranks split a pack evenly. Those tokens carry no loss,
but an MoE layer routes them like any other token, and Megatron-Core 0.19.2's router counts them in its
load-balancing loss (the tokens each expert took and the mean router probability), its z-loss and, with an expert
bias, the tokens per expert that update the bias. Pad tokens are one token id at positions that count from 0, so
they route alike and pull the balancing loss towards spreading them. The same pack trained without pipeline
or sequence parallelism has no pad and a different balancing loss.

Megatron-Core has the means: a layer's `padding_mask` (True where a token is pad) keeps pad tokens out of all three
(router.py `routing`, moe_utils.py `compute_routing_scores_for_aux_loss`) and still routes them, so the layer's
output is unchanged. But Megatron-Bridge's Qwen3-VL language model (Qwen3-VL-MoE and Qwen3.5-VL-MoE build it) does not
take a padding mask and its block does not pass one to the layers. Here the step marks the pack instead: its
`PackedSeqParams`, which every layer is given, is a `PaddedPack` that says where the pad starts (a host integer,
nothing read back from the device). While this group is applied, an MoE layer given such a pack and no mask builds
the mask for its own tokens: its tensor-parallel rank's share of the sequence under sequence parallelism. A layer
recomputed in the backward is called with the same pack and builds the same mask.

Upstream's masked count is not this rank's. With `calculate_per_token_loss` the router scales this rank's share of
the balancing loss by its token count times the tensor- and context-parallel ranks
(`TopKRouter.attach_and_log_load_balancing_loss`), so that each rank's share weighs what the group's tokens weigh.
Without a mask the count is the rank's rows; with one, Megatron-Core 0.19.2 sums the tokens per expert that the
mask keeps, after the all-reduce over the group has written the group's totals into them
(`get_tokens_per_expert_and_token_count`: `reduce_from_tensor_model_parallel_region` reduces in place), so the count
is the group's and the share weighs TP times too much: with sequence parallelism at TP=2, the balancing loss of every
padded pack weighed twice that of an unpadded one. With this group applied, a masked count is divided by its
group's size: the group's mean, what each rank counts where nothing is masked. Measured: tiny Qwen3-VL-MoE at TP=2,
its packs padded to `seq_length` (CUDA graphs) against the same packs padded to an even length, step-3 loss 7e-5
(relative) apart before, 8e-8 after.

Not covered: context parallelism splits each sub-sequence over the ranks in chunks; a layer there keeps
upstream's behaviour (no mask).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qvl.foundation.megatron import import_megatron_core

import_megatron_core()  # Megatron-Core's fused functions are decorated at its first import: under speed-import

from megatron.core.packed_seq_params import PackedSeqParams

GROUP = "fix-moe-pad-tokens"


@dataclass
class PaddedPack(PackedSeqParams):
    """A THD pack whose tokens from `pad_from` on are the pad sub-sequence."""

    pad_from: int | None = None


def pad_mask(layer: Any, hidden_states: torch.Tensor, packed_seq_params: Any) -> torch.Tensor | None:
    """The padding mask [batch, tokens] (True: pad) of the tokens `hidden_states` ([tokens, batch, hidden]) holds on
    this rank, for a pack marked by the step; None where nothing marks it or context parallelism splits it."""
    pad_from = getattr(packed_seq_params, "pad_from", None)
    config = layer.config
    if pad_from is None or (getattr(config, "context_parallel_size", 1) or 1) > 1:
        return None
    tokens, batch = hidden_states.shape[0], hidden_states.shape[1]
    first = layer.pg_collection.tp.rank() * tokens if config.sequence_parallel else 0
    positions = torch.arange(first, first + tokens, device=hidden_states.device)
    return (positions >= pad_from).unsqueeze(0).expand(batch, tokens)


def masking_pad(original: Callable) -> Callable:
    """Replacement factory for `TransformerLayer._forward_mlp`: an MoE layer given a marked pack and no padding mask
    routes with the pack's mask."""

    @functools.wraps(original)
    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        if padding_mask is None and self.is_moe_layer:
            padding_mask = pad_mask(self, hidden_states, packed_seq_params)
        return original(
            self, hidden_states, inference_context, padding_mask=padding_mask, packed_seq_params=packed_seq_params
        )

    return _forward_mlp


def weighed_evenly(original: Callable) -> Callable:
    """Replacement factory for `TopKRouter.attach_and_log_load_balancing_loss`: a masked router's token count (a
    tensor) is its reduce group's total, as upstream makes it (the all-reduce of the tokens per expert writes into
    the local counts it then sums), so this rank's count is that total over the group's size: every rank of the group
    weighs its share of the balancing loss alike, as where no pad is masked. A count given as a number (no mask, or
    a preference step's pairs: qvl.kernels.fix_preference_moe_aux) is left as it is."""

    @functools.wraps(original)
    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                           *args, **kwargs):  # fmt: skip
        count = kwargs.get("valid_token_count")
        ranks = reduce_group.size() if reduce_group is not None else 1
        if isinstance(count, torch.Tensor) and ranks > 1:
            kwargs["valid_token_count"] = count / ranks
        return original(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args, **kwargs)

    return attach_and_log_load_balancing_loss
