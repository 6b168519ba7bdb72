"""Where a job's processes meet: the one rule for MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK.

Three ways a qvl process is started, one answer each (`rendezvous(os.environ)`):

- **env**: torchrun (or another launcher) already set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; they are
  used as they are. On Slurm with more than one process per node, NeMo-Run starts one torchrun per node whose c10d
  store listens on the first node at MASTER_PORT (the Slurm port below), and torchrun sets each worker's values.
- **slurm**: srun started every rank itself (one process per node, no torchrun). RANK, WORLD_SIZE and LOCAL_RANK
  are SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID; MASTER_ADDR is the step's first node and MASTER_PORT
  `15000 + SLURM_JOB_ID % 10000`, the same on every node and different for jobs that share one (MASTER_ADDR or
  MASTER_PORT set in the job, e.g. by the site file, win). A port chosen by each process would differ per node and
  rank 1 would wait for rank 0 until the distributed timeout.
- **single**: one process: rank 0 of 1 on 127.0.0.1 and a free port (never a fixed one another run may hold).

The Slurm port is Megatron-Bridge's own choice for a Slurm job without MASTER_PORT
(megatron/bridge/utils/slurm_utils.py, `resolve_slurm_master_port`), so a rank that skips qvl's rule still agrees.
A Slurm job's batch script exports the rule's MASTER_ADDR and MASTER_PORT (`slurm_exports`), which is what
`qvl launch --dryrun` shows and what torchrun's rendezvous uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass

from qvl.foundation.errors import LaunchError

logger = logging.getLogger(__name__)

SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
RULES = {
    "env": "torchrun (or another launcher) set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; used as they are",
    "slurm": (
        "srun starts each rank: RANK=SLURM_PROCID, WORLD_SIZE=SLURM_STEP_NUM_TASKS, LOCAL_RANK=SLURM_LOCALID, "
        f"MASTER_ADDR=the first node, MASTER_PORT={SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}"
    ),
    "single": "one process: rank 0 of 1 on 127.0.0.1 and a free port",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """Where, and as which rank, one process joins its job's process group (torch's env:// variables)."""

    mode: str  # "env" | "slurm" | "single" (RULES says what each means)
    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int

    def env(self) -> dict[str, str]:
        """The five variables torch.distributed's env:// (and Megatron-Bridge) read."""
        values = (self.master_addr, self.master_port, self.rank, self.world_size, self.local_rank)
        return dict(zip(ENV_NAMES, map(str, values), strict=True))


def rendezvous(environ: Mapping[str, str]) -> Rendezvous:
    """The rendezvous of the process whose environment is `environ` (see the module docstring for the rule)."""
    if all(environ.get(name) for name in ENV_NAMES[:4]):
        return Rendezvous(
            mode="env",
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
        )
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or 1)  # not SLURM_NTASKS: the batch script itself has that
    if tasks > 1 and "SLURM_PROCID" in environ:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        return Rendezvous(
            mode="slurm",
            master_addr=environ.get("MASTER_ADDR") or first_slurm_node(nodes),
            master_port=int(environ.get("MASTER_PORT") or slurm_port(environ["SLURM_JOB_ID"])),
            rank=int(environ["SLURM_PROCID"]),
            world_size=tasks,
            local_rank=int(environ.get("SLURM_LOCALID", 0)),
        )
    return Rendezvous(
        mode="single", master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=1, local_rank=0
    )


@contextlib.contextmanager
def rendezvous_environment(environ: MutableMapping[str, str] = os.environ) -> Iterator[Rendezvous]:
    """`environ` holds this process's rendezvous while the block runs, and what it held before afterwards: the
    process group outlives the block and holds the port, so a process started later from here must not inherit it."""
    meeting = rendezvous(environ)
    logger.info(
        "rendezvous (%s): rank %d of %d meets at %s:%d",
        meeting.mode,
        meeting.rank,
        meeting.world_size,
        meeting.master_addr,
        meeting.master_port,
    )
    before = {name: environ.get(name) for name in ENV_NAMES}
    environ.update(meeting.env())
    try:
        yield meeting
    finally:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def slurm_port(job_id: str | int) -> int:
    """The rendezvous port of Slurm job `job_id` (the same on every node of the job)."""
    return SLURM_PORT_BASE + int(str(job_id).split("_")[0]) % SLURM_PORT_SPAN


def slurm_exports() -> dict[str, str]:
    """The rule's MASTER_ADDR and MASTER_PORT as a Slurm batch script exports them (NeMo-Run writes the values
    unquoted, so the shell expands them; `$head_node` is the allocation's first node in NeMo-Run's script)."""
    return {"MASTER_ADDR": "$head_node", "MASTER_PORT": f"$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))"}


def first_slurm_node(nodelist: str) -> str:
    """The first host of a Slurm node list: `node[01-04,07],gpu3` -> `node01`."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match or not match.group(0):
        raise LaunchError(f"SLURM node list {nodelist!r} names no node; start the ranks with srun inside a job")
    prefix, ranges = match.group(1), match.group(2)
    return prefix + re.split(r"[-,]", ranges)[0] if ranges else prefix


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
