"""Where `prepare`'s per-chunk and per-shard work runs: this process, N local worker processes, or a Ray cluster.

All three take the same jobs (a module-level function and its arguments) and hand results back as they finish;
each keeps at most a few jobs per worker in flight, so the driver never holds more than that much input.
Results come back in any order: callers make them order-independent (chunk files on disk, merged by number).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from qvl.foundation.errors import OptionalPackageUnavailable

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_WORKER = 2


@dataclass(kw_only=True, slots=True, frozen=True)
class RayConfig:
    """How to reach Ray: `address` None starts (or joins, via RAY_ADDRESS) a cluster on this machine."""

    address: str | None = None  # "auto", "ray://head:10001", "10.0.0.1:6379"; None: local
    num_cpus: int | None = None  # for a local cluster only
    temp_dir: pathlib.Path | None = None  # for a local cluster only (its sockets and logs)


class WorkerPool:
    """Runs `fn(*job)` for every job, calling `on_result` with each result as it finishes (any order)."""

    workers: int = 1
    name: str = "1 process"

    def map(self, fn: Callable, jobs: Iterable[tuple], on_result: Callable[[object], None]) -> None:
        for job in jobs:
            on_result(fn(*job))

    def close(self) -> None:
        pass


class ProcessPool(WorkerPool):
    """N worker processes on this machine.

    On Linux they are forked, so each starts with what the driver has already loaded (the tokenizer, the
    processor settings: `chunks.warm_up`) instead of spending seconds importing transformers again; elsewhere
    they are spawned. The driver starts no threads of its own before the pool (tokenizer parallelism is off for
    the run), so nothing a child inherits is held by a thread that is not there."""

    def __init__(self, workers: int):
        self.workers = workers
        self.name = f"{workers} worker processes"
        method = "fork" if sys.platform == "linux" else "spawn"
        # A forked child of a process whose tokenizer ran its thread pool would deadlock; this run never needs it.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))

    def map(self, fn: Callable, jobs: Iterable[tuple], on_result: Callable[[object], None]) -> None:
        pending: set[concurrent.futures.Future] = set()
        for job in jobs:
            pending.add(self._pool.submit(fn, *job))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                pending = self._drain(pending, on_result, concurrent.futures.FIRST_COMPLETED)
        self._drain(pending, on_result, concurrent.futures.ALL_COMPLETED)

    @staticmethod
    def _drain(pending, on_result, until) -> set:
        done, pending = concurrent.futures.wait(pending, return_when=until)
        for future in done:
            on_result(future.result())
        return pending

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayPool(WorkerPool):
    """Ray tasks (one CPU each) on a cluster's nodes; the workers need the same qvl and the same paths."""

    def __init__(self, settings: RayConfig):
        try:
            import ray
        except ImportError as err:
            raise OptionalPackageUnavailable(
                "--ray needs Ray; install it with `pip install 'qvl[ray]'` (or `pip install 'ray[default]>=2.40'`)"
            ) from err
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            kwargs = {"address": settings.address, "include_dashboard": False, "log_to_driver": False}
            if settings.address is None:
                kwargs.update(
                    num_cpus=settings.num_cpus, _temp_dir=str(settings.temp_dir) if settings.temp_dir else None
                )
            ray.init(**{k: v for k, v in kwargs.items() if v is not None or k == "address"})
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.name = f"Ray ({self.workers} CPUs)"
        self._remote: dict[Callable, object] = {}

    def map(self, fn: Callable, jobs: Iterable[tuple], on_result: Callable[[object], None]) -> None:
        ray = self._ray
        remote = self._remote.setdefault(fn, ray.remote(num_cpus=1, max_retries=2)(fn))
        pending = []
        for job in jobs:
            pending.append(remote.remote(*job))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                done, pending = ray.wait(pending, num_returns=1)
                on_result(ray.get(done[0]))
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            on_result(ray.get(done[0]))

    def close(self) -> None:
        if self._owns:
            self._ray.shutdown()


@contextlib.contextmanager
def worker_pool(workers: int | None, ray: RayConfig | None) -> Iterator[WorkerPool]:
    """The worker pool for `--workers N` (default: every core) or `--ray`; closed on exit."""
    if ray is not None:
        chosen: WorkerPool = RayPool(ray)
    else:
        workers = workers or len(os.sched_getaffinity(0))
        chosen = ProcessPool(workers) if workers > 1 else WorkerPool()
    logger.info("preparing with %s", chosen.name)
    try:
        yield chosen
    finally:
        chosen.close()
