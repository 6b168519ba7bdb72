"""Run a function on N local processes with Megatron's parallel state set up (gloo on CPU, nccl on GPUs).

For work that must happen at a given TP/PP layout on one machine (checkpoint conversion, parity
checks). Cluster jobs go through NeMo-Run executors instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from qvl.launchers import runtime


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, layout: dict, cpu: bool, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        runtime.activate(force=True)
    else:
        torch.cuda.set_device(rank)
    runtime.init_distributed(**layout)
    try:
        torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
    finally:
        runtime.destroy_distributed()


def run_on_ranks(fn: Callable[..., Any], *args: Any, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 world_size: int | None = None, cpu: bool | None = None) -> list[Any]:  # fmt: skip
    """Call `fn(*args)` on every rank of a local TP x PP (x DP) job; returns each rank's result, by rank.

    `fn` must be importable (module level) since ranks are spawned processes. With one rank it runs
    in this process.
    """
    world_size = world_size or tensor_parallel * pipeline_parallel
    if world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(f"world_size={world_size} is not divisible by tensor_parallel x pipeline_parallel = "
                         f"{tensor_parallel * pipeline_parallel}")  # fmt: skip
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    if not cpu and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    layout = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel}
    with tempfile.TemporaryDirectory(prefix="qvl-ranks-") as out:
        if world_size == 1:
            was_active = runtime.is_active()
            if cpu:
                runtime.activate(force=True)
            runtime.init_distributed(**layout)
            try:
                return [fn(*args)]
            finally:
                runtime.destroy_distributed()
                if cpu and not was_active:
                    runtime.deactivate()
        torch.multiprocessing.spawn(_rank_main, args=(world_size, runtime.free_port(), fn, args, layout, cpu, out),
                                    nprocs=world_size)  # fmt: skip
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
