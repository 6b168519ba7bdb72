"""The `qvl` command from a test: in a new interpreter where the process is what a test checks (its output, exit
status, environment, launcher), else through the same `main()` in the test's own process."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import subprocess
import sys
import tempfile
from pathlib import Path


def qvl(*args: str) -> str:
    """`qvl ARGS` in a new interpreter, for tests about the command's process: its output, exit and environment."""
    out = subprocess.run([sys.executable, "-m", "qvl.launchers.cli", *args], capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


def qvl_forked(*args: str) -> subprocess.CompletedProcess:
    """`qvl ARGS` in a process of its own forked from the session's server that has Megatron-Bridge imported (as
    local ranks are: qvl.foundation.distributed.start_ranks), for tests of what the command does as a process (its
    exit status, stdout and stderr, an exit inside it) that are not about a new interpreter's start-up: the ~20 s of
    CPU a new interpreter spends importing torch, Megatron and transformers is not spent again."""
    from qvl.foundation.distributed import start_ranks

    with tempfile.TemporaryDirectory(prefix="qvl-forked-") as out:
        start_ranks(_forked_main, (list(args), out), 1)
        code, stdout, stderr = ((Path(out) / name).read_text() for name in ("code", "stdout", "stderr"))
    return subprocess.CompletedProcess(["qvl", *args], int(code), stdout, stderr)


def _forked_main(rank: int, args: list[str], out: str) -> None:
    from qvl.foundation.distributed import output_to

    output_to(Path(out) / "stdout", Path(out) / "stderr")
    from qvl.launchers.cli import main

    code = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    (Path(out) / "code").write_text(str(code))


def qvl_in_process(*args: str) -> str:
    """`qvl ARGS` through the same `main()` in this process, for runs whose process is not what a test checks:
    no new interpreter importing torch, Megatron and transformers again (most of a tiny run's time on 2 cores).
    Returns what it printed and logged (records with their tracebacks), as `qvl` would show it; the process is left
    as found (`left_as_found`)."""
    from qvl.launchers.cli import main

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    try:
        with left_as_found(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(args))
    finally:
        logging.getLogger().removeHandler(handler)
    assert code == 0, out.getvalue()[-4000:]
    return out.getvalue()


@contextlib.contextmanager
def left_as_found(*, forget_groups: bool = True):
    """Ends what the block started that later tests may expect absent: a CPU runtime, a process group, an upstream
    patch group; and (`forget_groups`) drops what objects still alive name of the groups it destroyed."""
    import torch

    from qvl.foundation import distributed, patches, runtime

    was_active, was_initialized = runtime.is_active(), torch.distributed.is_initialized()
    applied_before = {group for group in patches.GROUPS if patches.is_applied(group)}
    threads = gloo_threads()
    try:
        yield
    finally:
        if torch.distributed.is_initialized() and not was_initialized:
            distributed.destroy_distributed()
        if forget_groups and not torch.distributed.is_initialized() and gloo_threads() > threads:
            gc.collect()
            forget_destroyed_process_groups()  # what the run's objects still name: their threads poll on otherwise
        if not was_active:
            runtime.deactivate()
        for group in reversed(patches.GROUPS):
            if group not in applied_before:
                patches.undo(group)


def qvl_on_two_ranks(*args: str) -> str:
    """`qvl ARGS` on two gloo ranks (what `torchrun --nproc_per_node 2 -m qvl.launchers.cli ARGS` runs), forked from
    the session's server that has Megatron imported (qvl.foundation.distributed.start_ranks): for runs whose
    launcher is not what a test checks. Returns both ranks' output, rank 0's first."""
    from qvl.foundation.distributed import run_on_ranks

    return "".join(run_on_ranks(qvl_on_rank, list(args), world_size=2, cpu=True))


def qvl_on_rank(args: list[str]) -> str:
    """`qvl ARGS` on a rank of `run_on_ranks` (its process group up): Megatron-Bridge sets the layout up itself."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # Megatron-Bridge sets the run's layout up itself
    return qvl_in_process(*args)


def gloo_threads() -> int:
    """Threads of this process's gloo process groups (two per group and a TCP loop; Linux's /proc)."""
    tasks = Path("/proc/self/task")
    names = (_read(task / "comm") for task in tasks.iterdir()) if tasks.is_dir() else ()
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # the thread ended meanwhile
        return ""


def forget_destroyed_process_groups() -> None:
    """Drop every reference that objects still alive hold to a process group already destroyed (no longer in
    torch's registry), so the group and its threads go: each leftover gloo group's TCP loop polls on, ~0.6% of a core
    apiece, and a test worker that gathered a few hundred spent a whole core on them."""
    import torch

    registry = torch.distributed.distributed_c10d._world.pg_map
    group = torch.distributed.ProcessGroup
    stale = lambda value: type(value) is group and value not in registry  # noqa: E731
    for holder in gc.get_objects():
        if type(holder) is dict:  # type(): isinstance() of a weak proxy whose object went raises
            for key in [key for key, value in holder.items() if stale(value)]:
                holder[key] = None
        elif type(holder) is list:
            for index in [index for index, value in enumerate(holder) if stale(value)]:
                holder[index] = None
    gc.collect()
