"""The CPU runtime: lets real Megatron-Core and Megatron-Bridge code run on a machine without a GPU.

Switched on explicitly with `activate()` (or `--device cpu` on the CLI), never as an import side effect,
and a no-op where CUDA is available. Every redirection is listed here with the reason it is needed;
`tests/launchers/test_runtime.py` exercises each one, so a Megatron version bump that breaks an
assumption fails there first. Checked against megatron-core 0.19.2 and megatron-bridge 0.6.2.

Redirections (undone by `deactivate()`):
1. Transformer Engine stand-in. `megatron.bridge.peft.lora_layers` does `import transformer_engine.pytorch
   as te` unconditionally, so `import megatron.bridge` fails without TE. `import_megatron_bridge()`
   registers a stand-in module only for the duration of that import and removes it afterwards, so later
   `try: import transformer_engine` probes still see TE as absent. The stand-in's classes can never be
   instantiated, so `isinstance(x, te.Linear)` is always False.
2. Device redirection (`_CudaToCpuMode`, a TorchFunctionMode). Megatron-Core creates tensors with
   `device="cuda"` / `torch.cuda.current_device()` in the causal-mask helpers (transformer/utils.py),
   the pipeline schedules (token counters), p2p shape exchange, grad clipping, grad scaler and the
   optimizers' found-inf flags, and calls `.cuda()` on state dicts. The mode rewrites any CUDA device
   argument of a torch call to CPU, and turns `Tensor.cuda()` / `Tensor.pin_memory()` into no-ops.
3. `Tensor.type()` reports `torch.cuda.*Tensor`. The (distributed) optimizer accepts only parameters
   whose `.type()` is `torch.cuda.FloatTensor` / `HalfTensor` / `BFloat16Tensor` (optimizer.py,
   distrib_optimizer.py); the same mode answers argument-less `.type()` calls with the CUDA name.
4. `torch.cuda` process-state functions. `current_device()` answers 0 (a device index that (2) maps to
   CPU); `set_device`, `synchronize`, `empty_cache`, `Stream`, `Event`, `current_stream`, `stream()`,
   `nvtx` become no-ops, because Megatron calls them unconditionally around communication and timing.
5. CUDA RNG -> CPU RNG. The model-parallel RNG tracker (`tensor_parallel/random.py`) forks the CUDA
   generator so dropout and initialisation differ across TP ranks but repeat across DP ranks. Without
   CUDA, `torch.cuda.manual_seed` is silently dropped and the tracker would fork nothing. The tracker's
   get/set-state helpers and `torch.cuda.{get,set}_rng_state, manual_seed` are pointed at the CPU
   generator, which keeps the fork-and-restore semantics exact. The tracker's "CPU RNG state changed
   within GPU RNG context" warning is then true by construction and is filtered out.
6. Distributed: `init_distributed()` initialises torch.distributed with the gloo backend and builds
   Megatron's parallel state on it.
7. Model configuration: `check_cpu_config()` refuses what CPU cannot run (FP8, sequence parallelism,
   Transformer Engine specs, CUDA graphs, communication overlap, hybrid-device optimizer offload) with
   the reason and the fix, and `cpu_safe_config_overrides()` lists the fusion flags to turn off.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------
# (1) Transformer Engine stand-in
# ---------------------------------------------------------------------------------------------------


class TransformerEngineUnavailable(RuntimeError):
    """Raised when code reaches a Transformer Engine feature on a machine without Transformer Engine."""


def _te_placeholder_class(name: str) -> type:
    def __init__(self, *args, **kwargs):  # noqa: N807
        raise TransformerEngineUnavailable(
            f"transformer_engine.pytorch.{name} was used, but Transformer Engine is not installed; "
            "use the local (non-TE) layer specs (qvl does on CPU), or run in a NeMo container with TE."
        )

    return type(name, (), {"__init__": __init__, "__module__": "transformer_engine.pytorch"})


class _StandInNamespace(types.ModuleType):
    """A module whose every attribute is a placeholder class (or a nested stand-in namespace)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StandInNamespace(f"{self.__name__}.{name}") if name.islower() else _te_placeholder_class(name)
        setattr(self, name, value)
        return value


@contextlib.contextmanager
def _transformer_engine_stand_in() -> Iterator[None]:
    """Make `import transformer_engine.pytorch` succeed inside the block only."""
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    names = ("transformer_engine", "transformer_engine.pytorch")
    root = _StandInNamespace(names[0])
    root.pytorch = _StandInNamespace(names[1])
    root.__path__ = []  # a package, so `import transformer_engine.pytorch` resolves
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({names[0]: root, names[1]: root.pytorch})
    try:
        yield
    finally:
        for n, previous in saved.items():
            if previous is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = previous


def import_megatron_bridge() -> types.ModuleType:
    """Import `megatron.bridge`, with the Transformer Engine stand-in where TE is absent."""
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    importlib.import_module("megatron.core")  # decides HAVE_TE=False before the stand-in exists
    with _transformer_engine_stand_in():
        return importlib.import_module("megatron.bridge")


def have_transformer_engine() -> bool:
    """True when the real Transformer Engine is importable."""
    return importlib.util.find_spec("transformer_engine") is not None and not isinstance(
        sys.modules.get("transformer_engine"), _StandInNamespace
    )


# ---------------------------------------------------------------------------------------------------
# (2, 3) Device redirection
# ---------------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # A bare int as a device argument means a CUDA ordinal; bools are not devices.
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; see the module docstring, items 2 and 3."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to:
            args = tuple(_CPU if i > 0 and _is_cuda_device(a) and not isinstance(a, int) else a for i, a in enumerate(args))
            if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------
# (4, 5) torch.cuda process state and RNG
# ---------------------------------------------------------------------------------------------------


class _NullStream:
    """Stands in for torch.cuda.Stream / Event / ExternalStream: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _null_stream_context(*args, **kwargs):
    return contextlib.nullcontext()


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu_generator(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _torch_cuda_patches() -> dict[tuple[Any, str], Any]:
    nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                 range=_null_stream_context, mark=lambda *a, **k: None)
    cuda = torch.cuda
    return {
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): lambda *a, **k: None,
        (cuda, "synchronize"): lambda *a, **k: None,
        (cuda, "empty_cache"): lambda *a, **k: None,
        (cuda, "Stream"): _NullStream,
        (cuda, "Event"): _NullStream,
        (cuda, "ExternalStream"): _NullStream,
        (cuda, "current_stream"): lambda *a, **k: _NullStream(),
        (cuda, "default_stream"): lambda *a, **k: _NullStream(),
        (cuda, "stream"): _null_stream_context,
        (cuda, "nvtx"): nvtx,
        (cuda, "get_rng_state"): _cpu_rng_state,
        (cuda, "set_rng_state"): _set_cpu_rng_state,
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
        (cuda, "manual_seed"): _seed_cpu_generator,
        (cuda, "manual_seed_all"): lambda seed: None,
        (cuda.random, "get_rng_state"): _cpu_rng_state,
        (cuda.random, "set_rng_state"): _set_cpu_rng_state,
    }


class _ForkedRngWarningFilter(logging.Filter):
    """Drops the tracker's CPU-RNG-changed warning, which (5) makes true on every fork."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_WARNING_FILTER = _ForkedRngWarningFilter()


def _megatron_patches() -> dict[tuple[Any, str], Any]:
    from megatron.core.tensor_parallel import random as mcore_random

    return {
        (mcore_random, "_get_cuda_rng_state"): _cpu_rng_state,
        (mcore_random, "_set_cuda_rng_state"): _set_cpu_rng_state,
    }


# ---------------------------------------------------------------------------------------------------
# Activation
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _RuntimeState:
    mode: _CudaToCpuMode | None = None
    originals: dict[tuple[Any, str], Any] = field(default_factory=dict)


_STATE = _RuntimeState()


def is_active() -> bool:
    """True while the CPU runtime's redirections are in place."""
    return _STATE.mode is not None


def activate(*, force: bool = False) -> bool:
    """Switch the CPU runtime on for this process; returns whether it is active.

    A no-op where CUDA is available, unless `force=True` (used by tests of the runtime itself).
    """
    if is_active():
        return True
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: the CPU runtime stays off")
        return False
    importlib.import_module("megatron.core")
    patches = {**_torch_cuda_patches(), **_megatron_patches()}
    for (owner, name), replacement in patches.items():
        _STATE.originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, replacement)
    logging.getLogger(_RNG_LOGGER).addFilter(_RNG_WARNING_FILTER)
    _STATE.mode = _CudaToCpuMode()
    _STATE.mode.__enter__()
    logger.debug("CPU runtime active: %d redirections", len(patches) + 1)
    return True


def deactivate() -> None:
    """Undo every redirection made by `activate()`."""
    if _STATE.mode is None:
        return
    _STATE.mode.__exit__(None, None, None)
    logging.getLogger(_RNG_LOGGER).removeFilter(_RNG_WARNING_FILTER)
    for (owner, name), original in _STATE.originals.items():
        setattr(owner, name, original)
    _STATE.originals.clear()
    _STATE.mode = None


@contextlib.contextmanager
def cpu_runtime(*, force: bool = False) -> Iterator[bool]:
    """Context-manager form of `activate()` / `deactivate()`."""
    active = activate(force=force)
    try:
        yield active
    finally:
        if active:
            deactivate()


# ---------------------------------------------------------------------------------------------------
# (6) Distributed
# ---------------------------------------------------------------------------------------------------


def init_distributed(
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    virtual_pipeline: int | None = None,
    seed: int = 1234,
) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) and Megatron's parallel state.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment as torchrun sets them;
    a single process without them becomes rank 0 of 1.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "gloo" if is_active() or not torch.cuda.is_available() else "nccl"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# (7) What CPU cannot run
# ---------------------------------------------------------------------------------------------------


class UnsupportedOnCPU(ValueError):
    """A configuration asks for something the CPU runtime cannot run."""


# (config field, value that is refused, why, fix)
_CPU_REFUSALS: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("fp8", lambda v: bool(v), "FP8 needs Transformer Engine on Hopper/Blackwell GPUs", "use fp32 or bf16"),
    ("sequence_parallel", lambda v: bool(v), "sequence parallelism needs TE/Apex fused norms and CUDA",
     "set sequence_parallel=False"),
    ("transformer_impl", lambda v: v == "transformer_engine", "Transformer Engine layer specs need TE and CUDA",
     "use the local layer spec (transformer_impl='local')"),
    ("enable_cuda_graph", lambda v: bool(v), "CUDA graphs need CUDA", "set enable_cuda_graph=False"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "CUDA graphs need CUDA", "set cuda_graph_impl='none'"),
    ("tp_comm_overlap", lambda v: bool(v), "communication overlap needs CUDA streams and userbuffers",
     "set tp_comm_overlap=False"),
    ("optimizer_cpu_offload", lambda v: bool(v), "the hybrid-device optimizer moves state between GPU and CPU",
     "set optimizer_cpu_offload=False (everything is on the CPU already)"),
)

# The local (non-TE) implementation, and fusions whose kernels exist only on CUDA (or need Apex/TE).
_CPU_FUSION_OVERRIDES: dict[str, Any] = {
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
}


def check_cpu_config(config: Any) -> None:
    """Raise UnsupportedOnCPU naming each field of `config` that CPU cannot run, with the fix."""
    problems = []
    for name, refused, why, fix in _CPU_REFUSALS:
        value = getattr(config, name, None)
        if value is not None and refused(value):
            problems.append(f"{name}={value!r}: {why}; {fix}")
    if problems:
        raise UnsupportedOnCPU("the CPU runtime cannot run this configuration:\n  - " + "\n  - ".join(problems))


def cpu_safe_config_overrides() -> dict[str, Any]:
    """TransformerConfig fields to set for a CPU run (fusions that only exist as CUDA kernels)."""
    return dict(_CPU_FUSION_OVERRIDES)
