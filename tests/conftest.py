"""Shared test set-up: no network, GPU tests skipped on CPU, the CPU runtime on demand, the cores shared by workers."""

from __future__ import annotations

import collections
import gc
import os
import sys

import pytest

from tests.run_qvl import forget_destroyed_process_groups, gloo_threads

# No test may reach a model hub; tiny models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def threads_per_worker(environ) -> int | None:
    """Under pytest-xdist, each worker's torch (and every process it starts) takes its share of the cores for its
    intra-op threads; None where one process runs the tests or OMP_NUM_THREADS is set already.

    torch's default is one OpenMP thread per core in every process; with a worker per core that is twice as many
    threads as cores, and a tiny model's small ops then wait on each other's spinning threads. Two six-step tiny
    fine-tunes, while another process ran the same, took 9.0 s with two threads and 6.1-6.5 s with one (alone: 6.8 s
    and 6.6 s)."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


if threads := threads_per_worker(os.environ):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this conftest: OpenMP has read the environment already
        sys.modules["torch"].set_num_threads(threads)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Under pytest-xdist (`make test` runs two workers, `--dist loadfile`) a test file runs whole on one worker, so its
# module fixtures are built once. These files also share one: each group's files run on the same worker.
SHARE_A_WORKER = {
    # the machine's one munged serves both Slurm clusters (tests/launchers/conftest.py)
    "munge_daemon": ("tests/launchers/test_slurm_real.py", "tests/launchers/test_slurm_multinode.py"),
    "tiny_census": ("tests/test_bench_step.py", "tests/kernels/test_speed_sync_free.py"),
    # one fresh interpreter checks the import-time claims of both (tests/foundation/conftest.py)
    "fresh_import_report": (
        "tests/foundation/test_patches.py",
        "tests/foundation/test_runtime.py",
        "tests/foundation/test_deferred_compile.py",
    ),
}
# The groups a worker takes second (each worker starts at once; the Slurm tests may first wait for the packages
# installing in the background); the rest go by their number of slow tests, most first.
SECOND = "munge_daemon"


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the order in which the groups are handed out
        _order_for_workers(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason='needs a CUDA GPU (on a GPU machine: make test PYTEST_ARGS="-m gpu")')
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def worker_group(nodeid: str) -> str:
    """The scope a test is handed out in: its file, or the group its file shares a fixture with."""
    path = nodeid.split("::")[0]
    return next((name for name, files in SHARE_A_WORKER.items() if path in files), path)


def _order_for_workers(items) -> None:
    for item in items:
        shared = {name for name in SHARE_A_WORKER if name in item.fixturenames}
        if shared and worker_group(item.nodeid) not in shared:
            raise pytest.UsageError(f"{item.path.name} uses {shared.pop()}: add it to SHARE_A_WORKER in {__file__}")
    slow = collections.Counter(worker_group(item.nodeid) for item in items if "slow" in item.keywords)
    order = sorted(dict.fromkeys(worker_group(item.nodeid) for item in items), key=lambda name: -slow[name])
    if SECOND in order:
        order.remove(SECOND)
        order.insert(min(1, len(order)), SECOND)
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank[worker_group(item.nodeid)])  # stable: a file keeps its order


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist is optional: one process runs the tests in file order
    pass
else:

    class SharedFileScheduling(LoadFileScheduling):
        """`--dist loadfile`, with the files of a SHARE_A_WORKER group as one scope, in collection order."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        return SharedFileScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


# The CPU runtime's groups stay as it set them: qvl.foundation.runtime tracks them (activate / deactivate).
RUNTIME_GROUPS = frozenset({"cpu-runtime", "cpu-training"})


def _logger_states() -> dict:
    import logging

    loggers = {"": logging.getLogger()} | {name: log for name, log in logging.Logger.manager.loggerDict.items()
                                            if isinstance(log, logging.Logger) and name.startswith("qvl")}  # fmt: skip
    return {name: (log, log.disabled, log.propagate, list(log.filters)) for name, log in loggers.items()}


# gc.unfreeze() calls, counted (gc.get_freeze_count() walks the frozen objects: ~0.2 s a call with Megatron imported).
_UNFREEZES = [0]
_unfreeze = gc.unfreeze


def _counted_unfreeze() -> None:
    _UNFREEZES[0] += 1
    _unfreeze()


gc.unfreeze = _counted_unfreeze


@pytest.fixture(autouse=True)
def process_left_as_found(request):
    """Each test leaves the process as it found it: upstream patch groups it applied are undone (model builds apply
    some for the rest of the process, as a training run does), a Megatron parallel state and a process group it
    started are destroyed (`_end_process_groups`), and the root and qvl loggers are restored (Megatron's
    setup_logging, run by every training loop, adds a filter that drops WARNING records to every existing logger),
    so no test depends on the order."""
    import logging
    import sys

    patches = sys.modules.get("qvl.foundation.patches")
    applied = {g for g in patches.GROUPS if patches.is_applied(g)} if patches else set()
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    initialized = bool(parallel_state and parallel_state.model_parallel_is_initialized())
    groups = _process_groups()
    loggers, disabled_below = _logger_states(), logging.root.manager.disable
    unfreezes = _UNFREEZES[0]
    yield
    logging.disable(disabled_below)
    for name, (log, disabled, propagate, filters) in _logger_states().items():
        log.disabled, log.propagate, log.filters = (*loggers[name][1:],) if name in loggers else (False, True, [])
    patches = sys.modules.get("qvl.foundation.patches")
    for group in reversed(patches.GROUPS if patches else ()):
        if group not in applied and group not in RUNTIME_GROUPS and patches.is_applied(group):
            patches.undo(group)
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state and not initialized and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _end_process_groups(groups)
    if log := os.environ.get("QVL_TEST_THREADS_LOG"):  # what each test left: `QVL_TEST_THREADS_LOG=FILE pytest ...`
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {gloo_threads()} {len(os.listdir('/proc/self/task'))} {request.node.nodeid}\n")
    if _UNFREEZES[0] > unfreezes:
        pytest.fail(
            "the test called gc.unfreeze(): it hands back to every later full collection of this process the objects "
            "frozen at import (foundation.megatron.gc_paused; ~0.5 s each collection); an Energon loader built in a "
            "test takes gc_collect_every_n_steps=0 (its default freezes, then unfreezes everything)",
            pytrace=False,
        )


@pytest.fixture(autouse=True, scope="module")
def module_left_as_found():
    """A test module leaves no process group behind: a default group its fixtures began ends with it, and objects
    still naming a group already destroyed (a model kept by a cache, a watchdog thread's dataset) let go of it."""
    groups = _process_groups()
    yield
    _end_process_groups(groups, forget=True)


def _process_groups() -> tuple[bool, int]:
    """(whether a default process group is up, this process's gloo threads): what a scope found."""
    import sys

    torch = sys.modules.get("torch")
    return bool(torch and torch.distributed.is_initialized()), gloo_threads()


def _end_process_groups(found: tuple[bool, int], *, forget: bool = False) -> None:
    """End the default group a scope began: while it lives, every later Megatron layout (a training loop's) adds
    its ~20 groups to torch's registry for good, and each gloo group's TCP loop polls at ~0.6% of a core (hundreds of
    them took a worker's two cores). Where gloo threads still outnumber those found, collect (a model or optimizer in
    a cycle still naming its groups) and, with `forget`, drop live objects' references to destroyed groups."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    was_up, threads = found
    if not was_up and torch.distributed.is_initialized():
        from qvl.foundation.distributed import destroy_distributed  # collects too

        destroy_distributed()
    if gloo_threads() > threads:
        gc.collect()
        if forget and gloo_threads() > threads:
            forget_destroyed_process_groups()


@pytest.fixture
def cpu_runtime():
    """The CPU runtime switched on for one test and off afterwards (forced on, so it runs on GPU hosts too)."""
    from qvl.foundation import runtime

    runtime.activate(force=True)
    yield runtime
    runtime.deactivate()


@pytest.fixture
def cpu_runtime_off():
    """The CPU runtime switched off for one test and put back as found: a worker runs many test files, and an earlier
    one may have left the runtime on for the process (as every training run does)."""
    from qvl.foundation import patches, runtime

    was_on, training = runtime.is_active(), patches.is_applied("cpu-training")
    runtime.deactivate()
    yield
    if was_on:
        runtime.activate(force=True)
    if training:
        runtime.enable_bridge_training()


@pytest.fixture
def free_port() -> int:
    from qvl.foundation.distributed import free_port

    return free_port()


@pytest.fixture(scope="session")
def tiny_qwen25_checkpoint(tmp_path_factory):
    """A tiny random Qwen2.5-VL HF checkpoint (the family record's debug flavour), written once per session."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint

    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen25") / "hf", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_dataset(tiny_qwen25_checkpoint, tmp_path_factory):
    """The shipped sample conversations prepared for the tiny Qwen2.5-VL at seq_length 256 (once per session)."""
    from qvl.data.prepare import PrepareConfig, prepare
    from qvl.data.samples import write_sample_dataset

    root = tmp_path_factory.mktemp("tiny-data")
    jsonl, media = write_sample_dataset(root / "samples")
    config = PrepareConfig(
        input=jsonl,
        media_root=media,
        family="qwen2_5_vl",
        hf_path=tiny_qwen25_checkpoint,
        seq_length=256,
        output=root / "data",
    )
    prepare(config)
    return root / "data"


@pytest.fixture(scope="session")
def tiny_qwen25_megatron(tiny_qwen25_checkpoint, tmp_path_factory):
    """The tiny Qwen2.5-VL imported to a Megatron torch_dist checkpoint in fp32 (`qvl convert import`, in this
    process), once per session: where fine-tunes at different layouts must start from the same weights."""
    from qvl.launchers.cli import main

    out = tmp_path_factory.mktemp("tiny-qwen25-megatron") / "megatron"
    command = ["convert", "import", str(tiny_qwen25_checkpoint), str(out), "--dtype", "fp32", "--device", "cpu"]
    assert main(command) == 0, "qvl convert import of the tiny checkpoint failed (error line in captured stderr)"
    return out


@pytest.fixture(scope="session")
def tiny_census(tmp_path_factory) -> dict:
    """One training step of the census's tiny config counted by `benchmarks.bench_step.census`, before qvl's step
    fixes (baseline) and after, once per session for the tests that read it. Each is trained in a child process;
    the two run at once (two processes, most of each is importing Megatron-Bridge)."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks import bench_step

    out = tmp_path_factory.mktemp("census")
    with ThreadPoolExecutor(2) as pool:
        runs = {mode: pool.submit(bench_step.census, "tiny", out / mode, baseline=mode == "before")
                for mode in ("before", "after")}  # fmt: skip
        return {mode: run.result() for mode, run in runs.items()}
