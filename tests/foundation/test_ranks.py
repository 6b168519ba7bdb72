"""Local ranks (`qvl.foundation.distributed.start_ranks`): when one fails, the others say where they are."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from qvl.foundation.distributed import output_to, start_ranks


def _rank(rank: int, out: str) -> None:
    output_to(Path(out) / f"rank{rank}.out", Path(out) / f"rank{rank}.err")  # what the rank prints, this test reads
    if rank == 1:
        raise RuntimeError("rank 1 gave up waiting for its peer")
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


def _caught_signals(rank: int, out: str) -> None:
    caught = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("SigCgt:"))
    (Path(out) / f"rank{rank}.sigcgt").write_text(caught.split()[1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")
def test_a_rank_is_forked_with_the_stack_signal_already_caught(tmp_path):
    # a rank that had not yet registered SIGUSR1 when its peer failed was ended by the signal itself, and the job
    # reported that instead of the peer's error: the forkserver registers it before any rank is forked
    start_ranks(_caught_signals, (str(tmp_path),), 1)
    assert int((tmp_path / "rank0.sigcgt").read_text(), 16) & (1 << (signal.SIGUSR1 - 1))
