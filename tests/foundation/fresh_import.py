"""qvl's import-time claims, checked in order in one fresh interpreter (the `fresh_import_report` fixture,
tests/foundation/conftest.py runs this file): each check prints one JSON line, {"check": NAME, "error": None or the
traceback, ...}. One process instead of one per claim: each new interpreter spends ~20 CPU s importing the stack."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
import traceback

import torch

ORIGINALS = {"current_device": torch.cuda.current_device, "manual_seed": torch.cuda.manual_seed}


def report(name: str, check) -> None:
    try:
        extra, error = check() or {}, None
    except BaseException:  # noqa: BLE001  (reported, the next check still runs)
        extra, error = {}, traceback.format_exc()
    print(json.dumps({"check": name, "error": error, **extra}), flush=True)


def registration_first() -> None:
    """The first qvl import: it gives Megatron-Bridge its Transformer Engine stand-ins itself."""
    import qvl.bridges.registration  # noqa: F401


def transformer_engine_free() -> dict:
    from qvl.foundation.megatron import have_transformer_engine, import_megatron_bridge
    from qvl.foundation.patches import KEPT_OUT

    if have_transformer_engine():
        return {"te_present": True}
    import_megatron_bridge()
    import megatron.bridge.training.pretrain  # noqa: F401
    from megatron.bridge.peft import lora_layers
    from megatron.core.utils import is_te_min_version

    assert "transformer_engine" not in sys.modules, "stand-in leaked"
    kept = [k.package for k in KEPT_OUT]
    assert not [n for n in kept if n in sys.modules], f"imported with Megatron-Bridge: {kept}"
    assert "torch._inductor.compile_fx" not in sys.modules, "a torch.compile wrapper was made at import"
    assert torch.compile.__module__ == "torch", "speed-import left applied"
    for name in kept:
        if importlib.util.find_spec(name):
            importlib.import_module(name)  # kept out of that one import only
    assert not is_te_min_version("0.1")
    assert not isinstance(object(), lora_layers.te.Linear)
    return {"te_present": False}


def fused_functions_eager_on_the_cpu() -> None:
    """Megatron-Core's fused functions, decorated at its first import (qvl's, under speed-import), run eagerly on the
    CPU: Qwen3.5's attention output gate compiles no frame."""
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()
    from megatron.core.transformer.attention import Attention
    from torch._dynamo.utils import counters

    x, gate = torch.randn(4, 1, 6), torch.randn(4, 1, 6)
    frames = counters["frames"]["total"]
    out = Attention._apply_output_gate(None, x, gate)
    assert torch.equal(out, x * torch.sigmoid(gate)), "the gate's values"
    assert counters["frames"]["total"] == frames, "the gate was compiled on the CPU"


def every_module_switches_nothing_on() -> None:
    from qvl.foundation import FOLDERS

    for folder in FOLDERS:
        for path in sorted(pathlib.Path(folder).rglob("*.py")):
            parts = path.with_suffix("").parts
            importlib.import_module(".".join(("qvl", *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:]))))
    from qvl.foundation import patches, runtime

    assert not runtime.is_active(), "the CPU runtime switched on at import"
    assert not patches._APPLIED, f"patch groups applied at import: {list(patches._APPLIED)}"
    ours = [f for f in sys.meta_path if type(f).__module__.startswith("qvl.")]
    assert not ours, f"import hooks left behind: {ours}"
    assert torch.cuda.current_device is ORIGINALS["current_device"]
    assert torch.cuda.manual_seed is ORIGINALS["manual_seed"]
    from torch.overrides import _get_current_function_mode_stack

    assert not _get_current_function_mode_stack(), "a torch function mode is on after the imports"


if __name__ == "__main__":
    report("registration_first", registration_first)
    report("transformer_engine_free", transformer_engine_free)
    report("fused_functions_eager_on_the_cpu", fused_functions_eager_on_the_cpu)
    report("every_module_switches_nothing_on", every_module_switches_nothing_on)
