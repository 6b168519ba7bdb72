"""Sequence parallelism without Transformer Engine: torch's norms where each rank holds a share of the sequence
(patch group "torch-sequence-parallel-norm" of qvl.foundation.patches).

Without Transformer Engine (and without Apex, whose fused norm is a LayerNorm only, while Qwen's is an RMSNorm)
Megatron-Core builds every norm of the language model, the final one and the MTP block's included, as
`WrappedTorchNorm` (megatron/core/transformer/torch_norm.py), which refuses `sequence_parallel` outright: "sequence
parallel not supported by torch LayerNorm". Every qvl recipe turns sequence parallelism on with tensor parallelism,
so a run with tensor_parallel >= 2 failed while its model was built, and an MoE model could not train with tensor
parallelism at all (Megatron-Core's MoE layer refuses TP without sequence parallelism in training).

Nothing in a norm's arithmetic depends on how the sequence is split: each token is normalised over its own hidden
vector. What sequence parallelism needs from a norm is its parameters' gradient summed over the tensor-parallel
ranks, since each rank's covers only its share of the tokens. Megatron-Core's TE and Apex norms mark their weights
`sequence_parallel`, and `finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`) all-reduces every
parameter so marked. This group builds torch's norm as upstream does and marks its parameters the same way where the
config has sequence parallelism on. Its collectives (all-gather and reduce-scatter along the sequence) are
Megatron-Core's own and run on NCCL and gloo alike, so the CPU runtime trains with sequence parallelism too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qvl.foundation import patches

GROUP = "torch-sequence-parallel-norm"


class _WithoutSequenceParallel:
    """A config that reads as `config` except that sequence parallelism is off (what upstream's checks see)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return False if name == "sequence_parallel" else getattr(self._config, name)


def sequence_parallel_norm(original: Callable) -> Callable:
    """Replacement factory for `WrappedTorchNorm.__new__`: upstream's norm, built without its sequence-parallel
    refusal, with its parameters marked `sequence_parallel` where the config has it on."""

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        norm = original(cls, _WithoutSequenceParallel(config), hidden_size, eps, *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm

    return __new__


def provide_norms() -> None:
    """The norms that take sequence parallelism, for the rest of the process (idempotent, as the CPU runtime and
    `torch-wgrad-accum` are: the norms are built with the model, their gradients reduced in every step after)."""
    patches.apply(GROUP)
