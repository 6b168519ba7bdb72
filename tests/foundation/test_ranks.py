"""Local ranks (`qvl.foundation.distributed.start_ranks`): when one fails, the others say where they are."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from qvl.foundation.distributed import _catches, output_to, start_ranks
from qvl.foundation.megatron import in_a_thread_of_its_own


def _rank(rank: int, out: str) -> None:
    output_to(Path(out) / f"rank{rank}.out", Path(out) / f"rank{rank}.err")  # what the rank prints, this test reads
    waiting = Path(out) / "rank0.waiting"
    if rank == 1:
        # fail once rank 0 waits: on a loaded machine it may still be importing this module when rank 1 is done,
        # and its stacks would then show the import (and go to the terminal, not its file)
        deadline = time.monotonic() + 60
        while not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 gave up waiting for its peer")
    waiting.touch()
    waiting_for_nothing(time.monotonic() + 120)


def waiting_for_nothing(deadline: float) -> None:
    while time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_failed_rank_ends_the_job_and_a_running_one_prints_where_it_is(tmp_path):
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 gave up waiting for its peer"):
        start_ranks(_rank, (str(tmp_path),), 2)
    assert time.monotonic() - start < 60  # rank 0 was ended, not waited for
    stacks = (tmp_path / "rank0.err").read_text()
    assert "most recent call first" in stacks and "in waiting_for_nothing" in stacks, stacks


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status (Linux)")
def test_the_stack_signal_goes_only_to_a_rank_that_catches_it():
    # a rank not yet that far when its peer failed would be ended by SIGUSR1, and the job would report that (CI saw
    # "process 0 terminated with signal SIGUSR1") instead of the peer's error
    plain = subprocess.Popen(["sleep", "30"])
    catching = subprocess.Popen([sys.executable, "-c", REGISTERS_SIGUSR1], stdout=subprocess.PIPE, text=True)
    try:
        assert catching.stdout.readline().strip() == "registered"
        assert _catches(catching.pid, signal.SIGUSR1) and not _catches(plain.pid, signal.SIGUSR1)
    finally:
        plain.kill()
        catching.kill()


REGISTERS_SIGUSR1 = (
    "import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1); "
    "print('registered', flush=True); time.sleep(30)"
)


def _matrix_product(seen: list[int]) -> None:
    seen.append(threading.get_native_id())
    a = torch.ones(64, 64)
    (a @ a).sum()  # MKL's exit handler has this thread's allocations to free


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc/self/task (Linux)")
def test_the_import_thread_has_left_the_process_when_its_result_is_returned():
    # Thread.join returns before the OS thread's C-level exit handlers ran (MKL frees under its allocator lock):
    # a fork in that window copies the lock held, and the child's first matrix product spins on it forever
    for _ in range(10):
        seen: list[int] = []
        in_a_thread_of_its_own(lambda: _matrix_product(seen))
        assert not Path(f"/proc/self/task/{seen[0]}").exists()


@pytest.mark.slow  # imports Megatron-Bridge in a fresh process (~15 s on 2 cores)
def test_the_forkservers_preload_writes_nothing_to_its_starters_stdout():
    """The forkserver shares the stdout of the process that starts it: Megatron's import-time INFO records (written to
    stdout by the root handler Megatron-LM installs) went into `bench_step --json`'s output before the JSON."""
    done = subprocess.run([sys.executable, "-c", "import qvl.foundation.rank_preload"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""
