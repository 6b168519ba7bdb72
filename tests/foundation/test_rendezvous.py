"""The rendezvous rule: torchrun's variables as they are, srun-started ranks meeting on one port, one process alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from qvl.foundation.errors import LaunchError
from qvl.foundation.rendezvous import (
    ENV_NAMES,
    first_slurm_node,
    rendezvous,
    rendezvous_environment,
    slurm_exports,
    slurm_port,
)


def _srun_env(rank: int, *, job: str = "1234567", nodes: str = "node[1-2]", tasks: int = 2) -> dict[str, str]:
    """What srun gives rank `rank` of a step with one task per node (as seen in a job on Slurm 22.05)."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(rank),
    }


def test_ranks_started_by_srun_on_two_nodes_meet_at_one_address_and_port():
    first, second = rendezvous(_srun_env(0)), rendezvous(_srun_env(1))
    assert (first.mode, second.mode) == ("slurm", "slurm")
    assert (first.master_addr, first.master_port) == (second.master_addr, second.master_port) == ("node1", 19567)
    assert (first.rank, second.rank, first.world_size, second.local_rank) == (0, 1, 2, 0)


def test_the_slurm_port_is_megatron_bridges_and_differs_between_jobs():
    # Megatron-Bridge's resolve_slurm_master_port: 15000 + the job id's last four digits.
    assert [slurm_port(j) for j in ("42", "1234567", "1234568", "77_3")] == [15042, 19567, 19568, 15077]


def test_a_port_or_address_set_in_the_job_wins_over_the_derived_one():
    meeting = rendezvous(_srun_env(1) | {"MASTER_PORT": "23456", "MASTER_ADDR": "10.0.0.5"})
    assert (meeting.mode, meeting.master_addr, meeting.master_port, meeting.rank) == ("slurm", "10.0.0.5", 23456, 1)


def test_torchrun_variables_are_used_as_they_are_even_inside_a_slurm_step():
    env = _srun_env(1) | {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400", "RANK": "3", "WORLD_SIZE": "4"}
    meeting = rendezvous(env | {"LOCAL_RANK": "1"})
    assert meeting.mode == "env"
    assert meeting.env() == {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400", "RANK": "3", "WORLD_SIZE": "4",
                             "LOCAL_RANK": "1"}  # fmt: skip


def test_one_process_and_a_batch_script_are_a_world_of_one_on_a_free_port():
    alone = rendezvous({})
    assert (alone.mode, alone.master_addr, alone.rank, alone.world_size) == ("single", "127.0.0.1", 0, 1)
    # The batch script itself (no srun step) sees SLURM_NTASKS of the whole job but is one process.
    batch = {k: v for k, v in _srun_env(0).items() if not k.startswith("SLURM_STEP")}
    assert rendezvous(batch).world_size == 1
    assert rendezvous(_srun_env(0, tasks=1)).mode == "single"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("node[1-2]", "node1"), ("gpu[007,009-012],cpu3", "gpu007"), ("a,b", "a"), ("x[3]", "x3")],
)
def test_first_slurm_node(nodelist, first):
    assert first_slurm_node(nodelist) == first


def test_an_empty_node_list_is_refused_with_the_way_on():
    with pytest.raises(LaunchError, match="srun"):
        rendezvous(_srun_env(0, nodes=""))


def test_the_batch_script_exports_compute_the_same_port_in_the_shell():
    exports = "".join(f"export {k}={v}\n" for k, v in slurm_exports().items())  # as NeMo-Run writes them
    script = f"head_node=node1\nSLURM_JOB_ID=1234567\n{exports}echo $MASTER_ADDR:$MASTER_PORT\n"
    shown = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert shown == f"node1:{slurm_port('1234567')}"


def test_the_environment_holds_the_rendezvous_only_inside_the_block():
    env = _srun_env(1) | {"MASTER_PORT": "24000"}
    with rendezvous_environment(env) as meeting:
        assert {k: env[k] for k in ENV_NAMES} == meeting.env()
        assert env["RANK"] == "1" and env["MASTER_ADDR"] == "node1"
    assert env == _srun_env(1) | {"MASTER_PORT": "24000"}


_JOIN = textwrap.dedent(
    """
    import os, sys, torch.distributed as dist
    from qvl.foundation.rendezvous import rendezvous_environment
    with rendezvous_environment() as meeting:
        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        total = dist.get_world_size()
        t = __import__("torch").tensor([meeting.rank + 1])
        dist.all_reduce(t)
        # one write per line: torchrun's workers share its stdout, and print() writes each piece on its own
        sys.stdout.write(f"{meeting.mode} {meeting.rank} {total} {int(t)}\\n")
        sys.stdout.flush()
        dist.destroy_process_group()
    """
)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ENV_NAMES and not k.startswith(("SLURM_", "TORCHELASTIC"))}


def _job_with_a_free_port() -> str:
    for job in range(os.getpid() % 9000 + 1000, 20000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", slurm_port(job)))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port in the Slurm rendezvous range")


def test_two_srun_style_processes_without_torchrun_form_one_group():
    """What hung before: one process per node, no torchrun; each process derives the same port from the job."""
    job = _job_with_a_free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _JOIN],
            env=_clean_env() | _srun_env(rank, job=job, nodes="localhost"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == ["slurm 0 2 3", "slurm 1 2 3"]


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_torchrun_with_c10d_rendezvous_gives_its_workers_values_as_they_are(free_port, tmp_path):
    script = tmp_path / "join.py"
    script.write_text(_JOIN)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port}", str(script)]
    done = subprocess.run(torchrun, env=_clean_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["env 0 2 3", "env 1 2 3"]
