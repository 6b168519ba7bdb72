"""Local ranks (`qvl.foundation.distributed.start_ranks`): when one fails, the others say where they are."""

from __future__ import annotations

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
