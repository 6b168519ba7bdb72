"""Process groups: torch.distributed + Megatron's parallel state (gloo on CPU, nccl on GPUs), and local ranks.

`run_on_ranks` runs a function on N local processes at a given TP/PP layout on one machine (checkpoint
conversion, parity checks). Cluster jobs go through NeMo-Run executors instead.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qvl.foundation import runtime
from qvl.foundation.patches import PRIVATE_READS
from qvl.foundation.rendezvous import free_port


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` local processes, like `torch.multiprocessing.spawn`, but forked from one server
    that has imported torch and Megatron-Bridge (started once per calling process): a rank starts in a fraction of a
    second instead of spending ~15 s of CPU importing them again. The server forks before any rank uses threads,
    CUDA or a process group; each rank takes the caller's environment and working folder as they are now."""
    multiprocessing.set_forkserver_preload(["qvl.foundation.rank_preload"])
    caller = (dict(os.environ), os.getcwd())
    context = torch.multiprocessing.start_processes(
        _as_caller, args=(caller, fn, args), nprocs=nprocs, start_method="forkserver", join=False
    )
    _stacks_of_the_others_on_failure(context.processes)
    while not context.join():  # raises the failed rank's error, ending the others
        pass


def _stacks_of_the_others_on_failure(processes: list, *, grace_s: float = 2.0) -> None:
    """Wait until every rank has ended or one has failed; then each rank still running prints its threads' Python
    stacks to its stderr (SIGUSR1, registered by the forkserver `rank_preload` before it forks a rank; a rank without
    it is not sent it, or the signal would end it) before it is ended: where a rank waits in a collective until its
    timeout, the stacks show where its peer is instead."""
    while alive := [p for p in processes if p.is_alive()]:
        multiprocessing.connection.wait([p.sentinel for p in alive])
        if any(p.exitcode not in (None, 0) for p in processes):
            for p in processes:
                if p.is_alive() and _catches(p.pid, signal.SIGUSR1):
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(grace_s)
            return


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` now (Linux: SigCgt in /proc/PID/status; elsewhere assumed):
    a rank without one yet would be ended by the signal, and the job would report that instead of its peer's error."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return not Path("/proc/self/status").exists()
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) & (1 << (signum - 1)))


def output_to(stdout: str | Path, stderr: str | Path | None = None) -> None:
    """This process's stdout and stderr (the file descriptors, so native code's output too) written to `stdout`,
    stderr to its own file where given: for a rank or child whose output its caller reads back."""
    for fd, path in ((1, stdout), (2, stderr or stdout)):
        with open(path, "a") as file:
            os.dup2(file.fileno(), fd)


def _as_caller(rank: int, caller: tuple[dict, str], fn: Callable, args: tuple) -> None:
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # Registered in the forkserver already (rank_preload); again here for a forkserver started without that preload.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn(rank, *args)


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, layout: dict, cpu: bool, out: str
) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        runtime.activate(force=True)
    else:
        torch.cuda.set_device(rank)
    init_distributed(**layout)
    try:
        torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    world_size: int | None = None,
    cpu: bool | None = None,
) -> list[Any]:
    """Call `fn(*args)` on every rank of a local TP x PP (x DP) job; returns each rank's result, by rank.

    `fn` must be importable (module level): ranks are separate processes (`start_ranks`). With one rank it runs
    in this process.
    """
    world_size = world_size or tensor_parallel * pipeline_parallel
    if world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"world_size={world_size} is not divisible by tensor_parallel x pipeline_parallel = "
            f"{tensor_parallel * pipeline_parallel}"
        )
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    if not cpu and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    layout = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel}
    with tempfile.TemporaryDirectory(prefix="qvl-ranks-") as out:
        if world_size == 1:
            was_active = runtime.is_active()
            if cpu:
                runtime.activate(force=True)
            init_distributed(**layout)
            try:
                return [fn(*args)]
            finally:
                destroy_distributed()
                if cpu and not was_active:
                    runtime.deactivate()
        start_ranks(_rank_main, (world_size, free_port(), fn, args, layout, cpu, out), world_size)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


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

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment as torchrun sets them.
    A single process without them becomes rank 0 of 1 on a free port, WITHOUT writing them into
    os.environ: processes it starts later (e.g. `qvl train` from a test) must not inherit a port
    this process may still hold.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = "gloo" if runtime.is_active() or not torch.cuda.is_available() else "nccl"
    if not torch.distributed.is_initialized():
        if "MASTER_PORT" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, or qvl's local ranks
            torch.distributed.init_process_group(backend=backend)
        else:
            torch.distributed.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
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
    forget_model_parallel_leftovers()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # A gloo group's threads (two and a TCP loop) end when the group object goes; models and optimizers of a finished
    # run still naming their groups in reference cycles would keep them until a full collection, which a process
    # that has frozen its imports' objects (qvl.foundation.megatron.gc_paused) seldom reaches on its own.
    gc.collect()


# Megatron-Core's destroy_model_parallel() resets every group it made but two (megatron-core 0.19.2), registered as
# private names qvl overrides.
LEFT_BY_DESTROY = tuple(r.attribute for r in PRIVATE_READS if r.used_in == __name__)


def forget_model_parallel_leftovers() -> None:
    """After Megatron's parallel state was destroyed, drop the two groups it still names (LEFT_BY_DESTROY): they keep
    the default group's store listening on its port (the next run in the process that reuses the port fails with
    EADDRINUSE) and their gloo threads polling. A no-op while the parallel state is up."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    for name in LEFT_BY_DESTROY:
        if getattr(parallel_state, name, None) is not None:
            setattr(parallel_state, name, None)
