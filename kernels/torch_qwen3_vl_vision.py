"""Megatron-Bridge's Qwen3-VL vision tower from Megatron-Core's local modules where Transformer Engine is absent
(patch group "torch-qwen3-vl-vision" of qvl.foundation.patches).

`Qwen3VLModel.__init__` (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py) builds its vision tower from
`get_vit_layer_with_transformer_engine_spec` and names TENorm / TEColumnParallelLinear / TERowParallelLinear for the
patch mergers, unconditionally. While qvl's `Qwen3VLModel` subclass (qvl.bridges.qwen3_vl) runs that `__init__`
without TE, those module globals point at Megatron-Core's local modules, with qvl's SDPA attention for the tower's
packed per-image sequences.
"""

from __future__ import annotations

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from qvl.kernels.varlen_attention import use_sdpa_attention

GROUP = "torch-qwen3-vl-vision"

# Replacement factories named by qvl.foundation.patches.


def local_vit_layer_spec(original):
    return lambda *args, **kwargs: use_sdpa_attention(get_vit_layer_with_local_spec())


def local_norm(original):
    return WrappedTorchNorm


def local_column_parallel_linear(original):
    return ColumnParallelLinear


def local_row_parallel_linear(original):
    return RowParallelLinear
