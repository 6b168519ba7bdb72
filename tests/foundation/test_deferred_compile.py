"""speed-import: torch.compile, while Megatron-Bridge imports, makes each decorated function at its first call that
runs fused (its tensors on CUDA, with Triton); a call on the CPU runs the eager function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from qvl.foundation.megatron import deferred_compile
from tests.foundation.conftest import check_passed

ROOT = Path(__file__).parents[2]


def _spy() -> tuple[list, object]:
    calls = []

    def compile_now(model, **options):
        calls.append((getattr(model, "__name__", model), options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))

    return calls, compile_now


def test_a_decorated_function_is_compiled_at_its_first_call_once_with_its_options():
    calls, compile_now = _spy()
    compile = deferred_compile(compile_now, fuses=lambda args, kwargs: True)

    @compile
    def plain(x):
        return x + 1

    @compile(dynamic=False, mode="max-autotune-no-cudagraphs")
    def with_options(x):
        return x * 2

    assert calls == [] and plain.__name__ == "plain"
    # unwrapped as torch.compile's own result is (qvl.kernels.torch_gated_delta keeps CPU helpers eager this way)
    assert plain._torchdynamo_orig_callable.__name__ == "plain" and plain._torchdynamo_orig_callable(1) == 2
    assert getattr(torch.compile(lambda x: x), "_torchdynamo_orig_callable", None) is not None
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert calls == [("plain", {}), ("with_options", {"dynamic": False, "mode": "max-autotune-no-cudagraphs"})]


def test_which_calls_run_fused():
    from qvl.foundation.megatron import fuses_here, jit_fusions_usable

    x = torch.ones(2)
    assert not fuses_here((object(), x), {}) and not fuses_here(((x, x), x, 0.0), {}) and not fuses_here((), {"x": x})
    assert fuses_here((1, "a"), {}) == jit_fusions_usable()  # no tensor: whether this machine fuses at all
    if torch.cuda.is_available():
        assert fuses_here((object(), x.cuda()), {}) == jit_fusions_usable()


def test_calls_after_the_first_fused_one_are_not_asked():
    calls, compile_now = _spy()
    asked = []

    @deferred_compile(compile_now, fuses=lambda args, kwargs: asked.append(args) or args[0] > 0)
    def plain(x):
        return x + 1

    assert plain(-1) == 0 and plain(1) == ("compiled", 2) and plain(-5) == ("compiled", -4)
    assert asked == [(-1,), (1,)] and calls == [("plain", {})]


def test_where_the_fusions_cannot_run_a_decorated_function_stays_eager():
    calls, compile_now = _spy()

    @deferred_compile(compile_now, fuses=lambda args, kwargs: False)
    def plain(x):
        return x + 1

    assert plain(1) == 2 and plain(2) == 3 and calls == []


def test_megatron_cores_fused_functions_run_eagerly_on_the_cpu(fresh_import_report):
    """Qwen3.5's attention output gate (`@jit_fuser`) ran eagerly, not compiled as C++ at its first call, in a process
    whose first Megatron-Core import was qvl's (tests/foundation/fresh_import.py: a test process may have imported
    Megatron-Core itself before, which decorates the functions without the deferral)."""
    check_passed(fresh_import_report, "fused_functions_eager_on_the_cpu")


def test_a_module_is_compiled_at_once_as_before():
    calls, compile_now = _spy()
    linear = torch.nn.Linear(2, 2)
    deferred_compile(compile_now)(linear, fullgraph=True)
    assert calls == [(linear, {"fullgraph": True})]


def test_inside_a_compiled_region_the_function_is_traced_inline_and_not_compiled_on_its_own():
    calls = []

    def compile_now(model, **options):
        calls.append(model.__name__)
        return torch.compile(model, backend="eager", **options)

    @deferred_compile(compile_now, fuses=lambda args, kwargs: True)
    def gelu_bias(x, bias):
        return torch.nn.functional.gelu(x + bias)

    @torch.compile(backend="eager", fullgraph=True)  # fullgraph: a graph break at the inner function would raise
    def layer(x, bias):
        return gelu_bias(x, bias) * 3

    x, bias = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(layer(x, bias), torch.nn.functional.gelu(x + bias) * 3)
    assert calls == []  # traced inline; called on its own afterwards it is compiled then
    assert torch.equal(gelu_bias(x, bias), torch.nn.functional.gelu(x + bias)) and calls == ["gelu_bias"]


def test_megatron_cores_fused_gated_delta_helpers_still_unwrap_to_eager_functions():
    """qvl.kernels.torch_gated_delta runs these helpers eagerly on the CPU by unwrapping what decorated them; a
    deferred function without the unwrapping attribute was compiled there instead (a Qwen3.5 fixture twice as slow)."""
    from qvl.foundation.megatron import import_megatron_bridge

    import_megatron_bridge()
    from qvl.kernels.torch_gated_delta import _EAGER_HELPERS, _UPSTREAM, _eager

    for name in _EAGER_HELPERS:
        method = getattr(_UPSTREAM, name)
        assert hasattr(method, "_torchdynamo_orig_callable"), f"{name} is no longer under jit_fuser"
        assert not hasattr(_eager(method), "_torchdynamo_orig_callable"), name


def test_the_cpu_runtime_switched_on_first_imports_megatron_core_with_its_fused_functions_deferred():
    """`qvl convert import --device cpu` switches the CPU runtime on before anything imports Megatron-Bridge; that
    first import of Megatron-Core decorated its fused functions with the real torch.compile, so every CPU process
    compiled Qwen3.5's attention output gate as C++ (~30 s with an empty TorchInductor cache, ~3 s with a warm one)."""
    code = (
        "import sys, torch\n"
        "from qvl.foundation import runtime\n"
        "runtime.activate(force=True)\n"
        "jit = sys.modules['megatron.core.jit']\n"
        "print(jit.jit_fuser is torch.compile, torch.compile.__module__, 'megatron.bridge' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "torch", "False"], done.stdout + done.stderr[-2000:]


def _imports_megatron(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Import | ast.ImportFrom):
        return False
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n.startswith(("megatron.core", "megatron.bridge")) or n == "megatron" for n in names)


def _calls_qvls_import(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", "") in (
        "import_megatron_core",
        "import_megatron_bridge",
    )


def test_every_module_imports_megatron_only_after_qvls_import_of_it():
    """Megatron-Core's first import decides its fused functions for the life of the process: a qvl module imported
    before any other that imported `megatron.core` at its top made them with the real torch.compile (found:
    qvl.kernels.fix_moe_pad_tokens). Each module that imports Megatron at its top calls qvl's import first."""
    from qvl.foundation import FOLDERS

    offenders = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            guarded = False
            for node in ast.parse(path.read_text()).body:
                guarded = guarded or _calls_qvls_import(node)
                if _imports_megatron(node) and not guarded:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                    break
    assert not offenders, f"import Megatron at the top before import_megatron_core() / _bridge(): {offenders}"
