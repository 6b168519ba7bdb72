"""A synchronous checkpoint save without a spawned helper process (patch group "speed-sync-save").

Megatron-Core 0.19.2 writes a torch_dist checkpoint through its async writer even when the save is synchronous
(megatron/core/dist_checkpointing/strategies/filesystem_async.py): the writer's threads report their results through
`get_write_results_queue()`, which the first time in a process starts a `multiprocessing` manager with the *spawn*
method. Spawning starts a new interpreter that imports the training script's main module again before it serves the
queue: the first save of every training process waited ~6 s for it and spent ~5 s of CPU there (seen on every rank
of a two-node job and in every new `qvl train` process).

A synchronous save (`checkpoint.async_save` off, every qvl recipe's default) writes and reads those results in the
same process (the writer's threads put them, the caller takes them after joining the threads), so an in-process
`queue.Queue` carries them; an asynchronous save writes from another process and keeps upstream's manager (the switch
leaves the group off for it).
"""

from __future__ import annotations

import queue
from collections.abc import Callable

GROUP = "speed-sync-save"


def in_process_results_queue(original: Callable[..., object]) -> Callable[..., queue.Queue]:
    """`get_write_results_queue` for synchronous saves: one `queue.Queue` per patched period, whatever `mp_mode`."""
    results: queue.Queue = queue.Queue()

    def get_write_results_queue(mp_mode: str = "spawn") -> queue.Queue:
        return results

    return get_write_results_queue
