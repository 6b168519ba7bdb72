"""Importing Megatron-Bridge where Transformer Engine or nvidia-resiliency-ext is absent (CPU, or a GPU without TE).

`megatron.bridge.peft.lora_layers` does `import transformer_engine.pytorch as te` and
`megatron.bridge.training.pretrain` does `from nvidia_resiliency_ext.inprocess import CallWrapper`
unconditionally, so without TE / nvrx `import megatron.bridge` and its training loop fail.
`import_megatron_bridge()` installs a meta-path finder that puts a stand-in in sys.modules only while one of
those modules executes, so every other probe (`try: import transformer_engine`, megatron.core's
`is_te_min_version`) still sees the package as absent. Stand-in classes cannot be instantiated:
`isinstance(x, te.Linear)` is always False and any real use raises OptionalPackageUnavailable naming the
package and the fix. Checked against megatron-core 0.19.2 and megatron-bridge 0.6.2.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

from qvl.foundation import patches
from qvl.foundation.errors import OptionalPackageUnavailable
from qvl.foundation.patch_entries import StandIn
from qvl.foundation.patches import KEPT_OUT, STAND_INS


def _placeholder_class(package: str, name: str, advice: str) -> type:
    def __init__(self, *args, **kwargs):  # noqa: N807
        raise OptionalPackageUnavailable(f"{package}: {name} was used, but {package} is not installed; {advice}.")

    return type(name, (), {"__init__": __init__, "__module__": package})


class _StandInNamespace(types.ModuleType):
    """A module whose every attribute is a placeholder class (or a nested stand-in namespace)."""

    def __init__(self, name: str, advice: str):
        super().__init__(name)
        self.__path__ = []  # a package, so submodule imports resolve through sys.modules
        self._advice = advice

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name.islower():
            value: Any = _StandInNamespace(f"{self.__name__}.{name}", self._advice)
        else:
            value = _placeholder_class(self.__name__.split(".")[0], name, self._advice)
        setattr(self, name, value)
        return value


@contextlib.contextmanager
def _stand_in(package: str, submodule: str, advice: str) -> Iterator[None]:
    """Make `import <submodule>` succeed inside the block only."""
    root = _StandInNamespace(package, advice)
    leaf = getattr(root, submodule.split(".", 1)[1])
    saved = {n: sys.modules.get(n) for n in (package, submodule)}
    sys.modules.update({package: root, submodule: leaf})
    try:
        yield
    finally:
        for n, previous in saved.items():
            if previous is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = previous


class _StandInLoader(importlib.abc.Loader):
    """Runs the real loader with the stand-in present for that one module's execution only, so that
    probes elsewhere (`try: import transformer_engine`, megatron.core's `is_te_min_version`) still
    see the package as absent."""

    def __init__(self, inner: importlib.abc.Loader, stand_in: StandIn):
        self.inner = inner
        self.stand_in = stand_in

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        with _stand_in(self.stand_in.package, self.stand_in.submodule, self.stand_in.advice):
            self.inner.exec_module(module)


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module in patches.STAND_INS whose optional package is not installed."""

    def find_spec(self, fullname, path, target=None):
        stand_in = _STAND_INS.get(fullname)
        if stand_in is None or _is_installed(stand_in.package):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _StandInLoader(spec.loader, stand_in)
        return spec


def _is_installed(package: str) -> bool:
    # A leftover folder (pip uninstall keeps unrecorded files) imports as an empty namespace package.
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


# TransformerConfig fields for Megatron-Core's local (non-TE) modules, on any device without Transformer Engine:
# gradient-accumulation fusion needs Apex's `fused_weight_gradient_mlp_cuda` (off here for models built directly;
# the providers qvl fixes turn it on with torch's GEMM in its place, qvl.kernels.torch_wgrad_accum); the others need kernels
# that only TE, Apex or the grouped_gemm package provide. SwiGLU's bias-activation fusion needs neither: `no_te_settings()` turns
# it on where CUDA and Triton are. (Megatron-Bridge's GPT provider leaves bias_dropout_fusion at Megatron-Core's
# default, off, and turns cross_entropy_loss_fusion on, a torch.jit fusion that needs no TE.) Where CUDA and Triton are
# not, `no_te_settings()` also turns bias_dropout_fusion off (Qwen3-VL-MoE's provider turns it on).
NO_TE_SETTINGS: dict[str, Any] = {
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "moe_grouped_gemm": False,
    "moe_permute_fusion": False,
}


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def jit_fusions_usable() -> bool:
    """Whether Megatron-Core's `jit_fuser` fusions (SwiGLU's bias-activation, bias-dropout-add) can run here: they
    are `torch.compile` regions (megatron/core/jit.py) that need CUDA and Triton, not TE or Apex. On the CPU
    TorchInductor would build them as C++ with the system compiler in every new process."""
    import torch

    return torch.cuda.is_available() and _triton_installed()


def no_te_settings() -> dict[str, Any]:
    """NO_TE_SETTINGS for this machine: SwiGLU's bias-activation fusion on where the fusions can run; where they
    cannot, bias-dropout-add off too (elsewhere the provider's value stays)."""
    if jit_fusions_usable():
        return {**NO_TE_SETTINGS, "bias_activation_fusion": True}
    return {**NO_TE_SETTINGS, "bias_activation_fusion": False, "bias_dropout_fusion": False}


_STAND_INS: dict[str, StandIn] = {s.module: s for s in STAND_INS}
_FINDER = _StandInFinder()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a block of heavy imports runs; then what exists is frozen (left
    out of every later collection, the one at exit included) and collection resumes.

    Importing Megatron-Bridge (or NeMo-Run) makes millions of objects that live as long as the process, and no
    garbage; the collector walks the growing heap again and again while they are made: 2.4 of the 13.9 CPU s of
    importing Megatron-Bridge on a 2-core build machine, and ~0.5 of the 5 s of a `qvl launch --dryrun`."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def import_megatron_bridge() -> types.ModuleType:
    """Import `megatron.bridge`, with stand-ins for the optional packages it imports unconditionally.

    The finder is on sys.meta_path only while this runs: the modules that need a stand-in (the LoRA layers and
    the training loop, which Megatron-Bridge would otherwise import lazily later) are imported here, once.
    """
    if all(name in sys.modules for name in ("megatron.core", "megatron.bridge", *_STAND_INS)):
        return sys.modules["megatron.bridge"]
    return in_a_thread_of_its_own(_import_megatron_bridge)


@contextlib.contextmanager
def _importing_megatron() -> Iterator[None]:
    """How qvl imports Megatron-Core and Megatron-Bridge: the collector paused, KEPT_OUT's packages out of reach of
    plugin loaders, and `speed-import` applied (its first import decides Megatron-Core's fused functions)."""
    with gc_paused(), kept_out(tuple(entry.package for entry in KEPT_OUT)), patches.applied(IMPORT_GROUP):
        yield


def _import_megatron_bridge() -> types.ModuleType:
    with _importing_megatron():
        importlib.import_module("megatron.core")  # decides HAVE_TE before anything else can
        sys.meta_path.insert(0, _FINDER)
        try:
            bridge = importlib.import_module("megatron.bridge")
            for name in _STAND_INS:
                importlib.import_module(name)
        finally:
            sys.meta_path.remove(_FINDER)
    return bridge


IMPORT_GROUP = "speed-import"  # the patch group applied while Megatron-Bridge imports


def import_megatron_core() -> types.ModuleType:
    """Import `megatron.core` alone, as `import_megatron_bridge()` begins: under `speed-import`. Megatron-Core
    decorates its fused functions at import (`@jit_fuser`), so its first import decides what they are for the life of
    the process; code that needs Megatron-Core before the bridge (the CPU runtime) imports it here."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    return in_a_thread_of_its_own(_import_megatron_core)


def _import_megatron_core() -> types.ModuleType:
    with _importing_megatron():
        return importlib.import_module("megatron.core")


def fuses_here(args: tuple, kwargs: dict) -> bool:
    """Whether a call of a Megatron-Core fused function runs fused: its first tensor argument (or first tensor in a
    tuple argument, as bias-dropout-add takes) is on CUDA, where Triton is. No tensor: `jit_fusions_usable()`."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, tuple | list):
            value = next((item for item in value if isinstance(item, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            return value.is_cuda and _triton_installed()
    return jit_fusions_usable()


def deferred_compile(
    compile_now: Callable[..., Any], *, fuses: Callable[[tuple, dict], bool] = fuses_here
) -> Callable[..., Any]:
    """`torch.compile` for the functions Megatron-Core decorates at import (`@jit_fuser`, `@torch.compile`): the
    decorated function is made with `compile_now` at its first call that runs fused (`fuses(args, kwargs)`: its
    tensors on CUDA, with Triton), which later calls then take; a call on the CPU before that runs the eager function,
    as qvl's own compiled regions do.

    torch.compile does no compiling before a first call anyway, but building its wrapper imports TorchInductor's
    compile_fx (~2 CPU s per process), which a process that never calls a fused function (a launcher, a converter, a
    CPU rank with the fusions off) then never needs. On the CPU a call would build the function as C++ with the system
    compiler in every new process (Qwen3.5's attention output gate: ~3 CPU s, ~30 s with an empty TorchInductor cache),
    for element-wise helpers that eager runs as fast. Modules and other objects are compiled as before."""

    def compile_at_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # `@torch.compile(...)` with options: the decorator
            return lambda fn: compile_at_first_call(fn, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        import torch

        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if torch.compiler.is_compiling():  # inside a compiled region: traced inline, as a nested compile is
                return model(*args, **kwargs)
            if compiled is None:  # once a call has run fused, later ones are not asked (no check on a GPU's step)
                if not fuses(args, kwargs):
                    return model(*args, **kwargs)
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        # As on what torch.compile returns: code that unwraps a compiled function (qvl.kernels.torch_gated_delta keeps
        # small helpers eager on the CPU) and dynamo's inlining of a nested compile read it.
        first_call_compiles._torchdynamo_orig_callable = model
        return first_call_compiles

    return compile_at_first_call


@contextlib.contextmanager
def kept_out(packages: tuple[str, ...]) -> Iterator[None]:
    """`import <package>` fails with ModuleNotFoundError inside the block (what a plugin loader skips), for each
    package not imported yet; afterwards it imports as usual (patches.KEPT_OUT)."""
    absent = [name for name in packages if name not in sys.modules]
    sys.modules.update(dict.fromkeys(absent))  # None: the import system's "not importable here"
    try:
        yield
    finally:
        for name in absent:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def in_a_thread_of_its_own(fn: Callable[[], Any]) -> Any:
    """`fn()` run in a new thread, its result returned (its exception raised) here.

    For first imports: modules imported under Megatron-Bridge keep the tracebacks of import errors they caught (pulp's
    solver probes), and a traceback keeps every frame above it, so an import from a caller's frame would keep that
    caller's locals (a config, a model, its process groups) for the life of the process. A new thread's stack holds
    nothing of the caller's."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001  (raised again in the caller's thread)
            outcome["error"] = err

    thread = threading.Thread(target=run, name="qvl-import")
    thread.start()
    thread.join()
    _until_the_os_thread_has_ended(thread.native_id)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _until_the_os_thread_has_ended(native_id: int | None, *, timeout_s: float = 10.0) -> None:
    """Wait until a joined thread has left the process (Linux: its /proc/self/task entry is gone).

    `Thread.join` returns once the thread's Python state is released, before the OS thread runs its C-level exit
    handlers. A thread that imported torch has used MKL (torch sets MKL's thread count at import), and MKL's exit
    handler frees the thread's accounting under MKL's allocator lock. A process forked in that window (the forkserver
    that `start_ranks` forks ranks from forks the first one right after its import) copies the lock held by a thread it
    does not have: the rank's first matrix product then spins on it forever (seen as a TP=2 rank at 100% CPU in
    `mkl_serv_allocate`, its peer waiting in a collective)."""
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout_s
    while native_id is not None and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


def have_transformer_engine() -> bool:
    """True when the real Transformer Engine is importable."""
    return _is_installed("transformer_engine")


def gated_delta_net(model: Any) -> bool:
    """Whether the language model of `model` (its provider or TransformerConfig) has Gated DeltaNet (linear attention)
    layers: Megatron-Core's experimental attention variant, Qwen3.5's hybrid pattern."""
    return getattr(model, "experimental_attention_variant", None) == "gated_delta_net"


def filter_except_qvl(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """`add_filter_to_all_loggers` that leaves qvl's loggers alone.

    Megatron-Bridge's setup (`setup_logging`, `logger.filter_warnings=True` by default) gives the root logger and every
    logger that exists a filter that drops WARNING records, for the rest of the process: after a training loop in a
    notebook or `qvl.training.train()`, qvl's own warnings (an option that falls back, a check that found something)
    were silently gone. Other libraries' loggers still get the filter, as upstream intends."""

    def add_filter_to_all_loggers(filter: Any) -> None:
        logging.getLogger().addFilter(filter)
        for name in list(logging.root.manager.loggerDict):
            if name != "qvl" and not name.startswith("qvl."):
                logging.getLogger(name).addFilter(filter)

    return add_filter_to_all_loggers


def prebuilt_dataset_helpers(original: Callable[[], None]) -> Callable[[], None]:
    """`compile_helpers` that builds Megatron-Core's dataset helpers only where they are not built yet.

    The megatron-core wheel ships `helpers_cpp` compiled and no Makefile, so upstream's unconditional `make`
    fails and `sys.exit(1)`s a pip-installed run; a source checkout (a NeMo container) has no module yet, and
    builds it as before."""

    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            original()

    return compile_helpers
