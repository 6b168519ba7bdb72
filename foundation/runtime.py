"""The CPU runtime: lets real Megatron-Core and Megatron-Bridge code run on a machine without a GPU.

Switched on explicitly with `activate()` (or `--device cpu` on the CLI), never as an import side effect,
and a no-op where CUDA is available. Every redirection is listed here with the reason it is needed;
`tests/foundation/test_runtime.py` exercises each one, so a Megatron version bump that breaks an
assumption fails there first. Checked against megatron-core 0.19.2 and megatron-bridge 0.6.2.

Redirections (undone by `deactivate()`); the attribute replacements among them are the patch groups
"cpu-runtime" and "cpu-training" of qvl.foundation.patches:
1. Stand-ins for optional packages (TE, nvrx) that Megatron-Bridge imports unconditionally: see
   qvl.foundation.megatron; needed on CPU and on GPUs without TE alike.
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
6. Distributed: `qvl.foundation.distributed.init_distributed()` picks gloo while this runtime is active.
7. Megatron-Bridge's training loop (`enable_bridge_training()`, on top of `activate()`):
   `initialize_megatron` asserts CUDA unless `allow_no_cuda`, which its setup path never passes, and
   `_set_random_seed` registers the model-parallel RNG tracker only when a CUDA device is counted, so on
   CPU every tracker fork fails. The first gets allow_no_cuda=True, the second also seeds the tracker.
   (Upstream's `make` of the dataset helpers, which the wheel ships built, is not CPU-specific: the group
   "fix-megatron-setup" around every training loop handles it, qvl.foundation.megatron.prebuilt_dataset_helpers.)
8. Model configuration: `check_cpu_config()` refuses what CPU cannot run (FP8, sequence parallelism,
   Transformer Engine specs, CUDA graphs set by hand, communication overlap, hybrid-device optimizer offload)
   with the reason and the fix, and `cpu_safe_config_overrides()` lists the fusion flags to turn off. The
   recipe option `cuda_graphs=true` does run on the CPU: its graphs are recorded and replayed as the ops they
   ran (patch group "cpu-cuda-graphs", qvl.foundation.graph_replay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from qvl.foundation import patches
from qvl.foundation.errors import UnsupportedOnCPU
from qvl.foundation.megatron import NO_TE_SETTINGS, import_megatron_bridge, import_megatron_core

logger = logging.getLogger(__name__)

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
            args = tuple(
                _CPU if i > 0 and _is_cuda_device(a) and not isinstance(a, int) else a for i, a in enumerate(args)
            )
            if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], _CPU, *args[2:])
        if func is torch.autograd.grad:
            return grad_with_mode_on(self, args, kwargs)
        return func(*args, **kwargs)


def grad_with_mode_on(mode: TorchFunctionMode, args: tuple, kwargs: dict):
    """`torch.autograd.grad` with `mode` (a TorchFunctionMode handling that call) on while its backward runs. A mode
    is off while it handles a call, and here the call is the whole backward, whose nodes run with the thread's state
    as it was when the engine started: custom Functions' backward that make tensors on "cuda" (Megatron-Core's TP
    collectives) would miss this runtime's redirection, and a recorded CUDA graph's capture its backward
    (qvl.foundation.graph_replay). (Megatron-Core's schedules call the engine directly, without a torch function; its
    CUDA graphs' warm-ups and captures call `torch.autograd.grad`.) So the engine is called here as `grad` calls it,
    the mode on."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    names = ("outputs", "inputs", "grad_outputs", "retain_graph", "create_graph", "only_inputs", "allow_unused")
    bound = dict(zip(names, args)) | kwargs
    plain = not bound.get("is_grads_batched") and not bound.get("materialize_grads")
    outputs, inputs = bound["outputs"], bound["inputs"]
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not plain or not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        return torch.autograd.grad(*args, **kwargs)  # what this does not cover runs as before (the mode off)
    grad_outputs = _tensor_or_tensors_to_tuple(bound.get("grad_outputs"), len(outputs))
    grad_outputs = _make_grads(outputs, grad_outputs, is_grads_batched=False)
    create_graph = bound.get("create_graph", False)
    retain_graph = create_graph if bound.get("retain_graph") is None else bound["retain_graph"]
    allow_unused = bool(bound.get("allow_unused"))
    with mode:
        return _engine_run_backward(
            outputs, grad_outputs, retain_graph, create_graph, tuple(inputs), allow_unused, accumulate_grad=False
        )


# ---------------------------------------------------------------------------------------------------
# (4, 5) torch.cuda process state and RNG
# ---------------------------------------------------------------------------------------------------


class _NullStream:
    """Stands in for torch.cuda.Stream / Event / ExternalStream: every method is a no-op that returns
    another stand-in, so chains such as `stream.record_event().synchronize()` (MoE token dispatch) work."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str) -> Callable[..., _NullStream]:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _NullStream()

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


def _cpu_rng_state(*args, graph_safe: bool = False, **kwargs) -> torch.Tensor | torch.Generator:
    # graph_safe: Megatron-Core's tracker for CUDA graphs keeps generators, not state tensors; a copy of the CPU
    # generator keeps the same fork-and-restore semantics (qvl.foundation.graph_replay runs graphs on the CPU)
    return torch.default_generator.clone_state() if graph_safe else torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor | torch.Generator, *args, **kwargs) -> None:
    if isinstance(new_state, torch.Generator):
        torch.default_generator.set_state(new_state.get_state())
    else:
        torch.set_rng_state(new_state)


# Replacement factories named by qvl.foundation.patches (group "cpu-runtime"): each gets the original.


def answer_device_zero(original: Any) -> Callable[[], int]:
    return lambda: 0


def no_op(original: Any) -> Callable[..., None]:
    return lambda *args, **kwargs: None


def null_stream_class(original: Any) -> type:
    return _NullStream


def null_stream_factory(original: Any) -> Callable[..., _NullStream]:
    return lambda *args, **kwargs: _NullStream()


def null_stream_context(original: Any) -> Callable[..., Any]:
    return _null_stream_context


def null_nvtx(original: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=_null_stream_context,
        mark=lambda *a, **k: None,
    )


def cpu_rng_state(original: Any) -> Callable[..., torch.Tensor]:
    return _cpu_rng_state


def set_cpu_rng_state(original: Any) -> Callable[..., None]:
    return _set_cpu_rng_state


def seed_cpu_generator(original: Any) -> Callable[[int], None]:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    return lambda seed: torch.default_generator.manual_seed(int(seed))


# Replacement factories of group "cpu-training" (item 7).


def allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    return functools.wraps(original)(lambda *args, **kwargs: original(*args, **{**kwargs, "allow_no_cuda": True}))


def seed_rng_tracker_too(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False,
                        use_cudagraphable_rng=False, **kwargs):  # fmt: skip
        original(seed_, data_parallel_random_init, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                 **kwargs)  # fmt: skip
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # the seed upstream would have used (it offsets by pipeline rank), and its tracker: graph-safe where the
        # model asks for CUDA graphs (qvl.foundation.graph_replay runs them on the CPU)
        model_parallel_cuda_manual_seed(
            seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank(),
            te_rng_tracker,
            inference_rng_tracker,
            use_cudagraphable_rng,
        )

    return set_random_seed


def split_sizes_as_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what upstream hands all_to_all_single after its device-to-host copy
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


class _ForkedRngWarningFilter(logging.Filter):
    """Drops the tracker's CPU-RNG-changed warning, which (5) makes true on every fork."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_WARNING_FILTER = _ForkedRngWarningFilter()


# ---------------------------------------------------------------------------------------------------
# Activation
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _RuntimeState:
    mode: _CudaToCpuMode | None = None


_STATE = _RuntimeState()
_GROUPS = ("cpu-runtime", "cpu-training")


def is_active() -> bool:
    """True while the CPU runtime's redirections are in place."""
    return _STATE.mode is not None


def activate(*, force: bool = False) -> bool:
    """Switch the CPU runtime on for this process; returns whether it is active.

    A no-op where CUDA is available, unless `force=True` (used by tests of the runtime itself).
    """
    if is_active():
        patches.apply("cpu-runtime")  # idempotent; puts back redirections undone through the registry directly
        return True
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: the CPU runtime stays off")
        return False
    import_megatron_core()  # the cpu-runtime patches replace some of its functions
    patches.apply("cpu-runtime")
    logging.getLogger(_RNG_LOGGER).addFilter(_RNG_WARNING_FILTER)
    _STATE.mode = _CudaToCpuMode()
    _STATE.mode.__enter__()
    logger.debug("CPU runtime active")
    return True


def enable_bridge_training() -> None:
    """Make Megatron-Bridge's pretrain/finetune loop run on CPU (item 7 above); needs `activate()` first."""
    if not is_active():
        raise RuntimeError("call runtime.activate() before enable_bridge_training()")
    import_megatron_bridge()
    patches.apply("cpu-training")


def deactivate() -> None:
    """Undo every redirection made by `activate()` and `enable_bridge_training()`."""
    if _STATE.mode is None:
        return
    _STATE.mode.__exit__(None, None, None)
    logging.getLogger(_RNG_LOGGER).removeFilter(_RNG_WARNING_FILTER)
    for group in reversed(_GROUPS):
        patches.undo(group)
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
# (7) What CPU cannot run
# ---------------------------------------------------------------------------------------------------


# (config field, value that is refused, why, fix)
_CPU_REFUSALS: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("fp8", lambda v: bool(v), "FP8 needs Transformer Engine on Hopper/Blackwell GPUs", "use fp32 or bf16"),
    (
        "transformer_impl",
        lambda v: v == "transformer_engine",
        "Transformer Engine layer specs need TE and CUDA",
        "use the local layer spec (transformer_impl='local')",
    ),
    ("enable_cuda_graph", lambda v: bool(v), "CUDA graphs need CUDA", "set enable_cuda_graph=False"),
    (
        "cuda_graph_impl",
        lambda v: v not in (None, "none"),
        "CUDA graphs need CUDA",
        "set cuda_graph_impl='none' (the recipe option cuda_graphs=true runs qvl's graphed step on the CPU, recorded)",
    ),
    (
        "tp_comm_overlap",
        lambda v: bool(v),
        "communication overlap needs CUDA streams and userbuffers",
        "set tp_comm_overlap=False",
    ),
    (
        "optimizer_cpu_offload",
        lambda v: bool(v),
        "the hybrid-device optimizer moves state between GPU and CPU",
        "set optimizer_cpu_offload=False, the recipe option optimizer_offload=0 (everything is on the CPU already)",
    ),
)

# The local (non-TE) implementation, and also the jit-scripted fusions, whose kernels exist only on CUDA.
_CPU_FUSION_OVERRIDES: dict[str, Any] = {
    **NO_TE_SETTINGS,
    "bias_dropout_fusion": False,
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


def cpu_training_config(config: Any) -> None:
    """Set what a Megatron-Bridge ConfigContainer needs to train on CPU (gloo, loaders in-process, no pinned
    memory), then refuse, naming each field, what the CPU runtime cannot run (e.g. bf16: pass precision=fp32)."""
    config.dist.distributed_backend = "gloo"
    config.dataset.num_workers = 0
    config.dataset.pin_memory = False
    check_cpu_config(config.model)
    check_cpu_config(config.optimizer)  # its CPU offload (the recipe's optimizer_offload)


def cpu_safe_config_overrides() -> dict[str, Any]:
    """TransformerConfig fields to set for a CPU run (fusions that only exist as CUDA kernels)."""
    return dict(_CPU_FUSION_OVERRIDES)
