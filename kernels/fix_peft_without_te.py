"""Megatron-Bridge's LoRA and DoRA on Megatron-Core's local (non-TE) linears, where Transformer Engine is absent.

Without TE, Megatron-Core sets `te = MagicMock()` (megatron/core/extensions/transformer_engine.py ~69-85), so every
`safe_import_from("megatron.core.extensions.transformer_engine", "TE...Linear")` in Megatron-Bridge succeeds with a
mock: `megatron/bridge/peft/utils.py` (~86-95) and `peft/module_matcher.py` (~148-155) conclude that TE is present
and take their TE branches, where `isinstance(m, <mock>)` raises `TypeError: isinstance() arg 2 must be a type`
(utils.py:591) for every LoRA target. With the flags false, Megatron-Bridge takes its own plain Megatron-Core
branches (ColumnParallelLinear / RowParallelLinear, utils.py ~634-641), which train, checkpoint and resume.

`without_te()` applies the group around a PEFT transform only where TE is really absent; with TE installed the
flags are right and nothing is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from qvl.foundation import patches
from qvl.foundation.megatron import have_transformer_engine

GROUP = "fix-peft-without-te"


def te_absent(original: bool) -> bool:
    """Patch factory for Megatron-Bridge's HAVE_TE* flags: False, since the group applies only without TE."""
    return False


@contextlib.contextmanager
def without_te() -> Iterator[None]:
    """The group applied for the block where Transformer Engine is not installed (nothing otherwise)."""
    with patches.applied(GROUP) if not have_transformer_engine() else contextlib.nullcontext():
        yield
