"""Per-step anatomy of a training run, recorded inside the training child (benchmarks/train_run.py) for bench_idle.

For every step: wall seconds between the step's start and end callbacks (the device synchronised at both), the
packs it consumed, Megatron's timers (Megatron-Bridge at `timing_log_level=2`: forward-compute, backward-compute,
the optimizer and its parts; read and reset here, so the training log's own timer lines show what is left after
that), and on CUDA the allocator counters of `torch.cuda.memory_stats()` as per-step deltas (cudaMalloc and cudaFree
calls, allocation retries: each retry frees cached blocks and synchronises) with the step's peak. On chosen steps,
CUPTI records the device's kernels, copies and sets (`torch.profiler` with the CUDA activity only, no CPU-op
recording, so the host pays little): the union of their intervals is the step's GPU busy time, and wall minus busy
is the time the GPU sat idle.
"""

from __future__ import annotations

import time

import torch

# Cumulative counters of torch.cuda.memory_stats(), reported per step as deltas.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def busy_seconds(intervals: list[tuple[int, int]]) -> float:
    """Length of the union of (start_ns, end_ns) intervals, in seconds."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e9


def device_intervals(profiler: torch.profiler.profile) -> list[tuple[int, int]]:
    """(start_ns, end_ns) of every device-side event (kernels, memcpy, memset) the profiler recorded."""
    events = profiler.profiler.kineto_results.events()
    return [(e.start_ns(), e.end_ns()) for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]


class StepAnatomy:
    """Callbacks for Megatron-Bridge's CallbackManager; `steps` holds one dict per training step."""

    def __init__(self, *, batches: list, profiled: set[int]):
        self.batches = batches  # the timed loader's per-micro-batch records (train_run.RECORDER.batches)
        self.profiled = profiled  # 1-based steps recorded by CUPTI
        self.cuda = torch.cuda.is_available()
        self.steps: list[dict] = []
        self._start = 0.0
        self._consumed = 0
        self._counters: dict[str, int] = {}
        self._profiler: torch.profiler.profile | None = None

    def step_start(self, context) -> None:
        step = context.state.train_state.step + 1
        if self.cuda:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            self._counters = {name: stats.get(name, 0) for name in ALLOCATOR_COUNTERS}
            torch.cuda.reset_peak_memory_stats()
            if step in self.profiled:
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self._profiler.start()
        self._consumed = len(self.batches)
        self._start = time.perf_counter()

    def step_end(self, context) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._start
        record = {
            "step": context.state.train_state.step,
            "packs": len(self.batches) - self._consumed,
            "wall_s": round(wall, 6),
            "timers_s": _timers(context.state.timers),
        }
        if self.cuda:
            stats = torch.cuda.memory_stats()
            record["allocator"] = {name: stats.get(name, 0) - self._counters[name] for name in ALLOCATOR_COUNTERS}
            record["peak_allocated_gib"] = round(stats.get("allocated_bytes.all.peak", 0) / 2**30, 3)
            record["reserved_gib"] = round(stats.get("reserved_bytes.all.current", 0) / 2**30, 3)
        if self._profiler is not None:
            self._profiler.stop()
            busy = busy_seconds(device_intervals(self._profiler))
            record["gpu_busy_s"] = round(busy, 6)
            record["gpu_idle_fraction"] = round(max(wall - busy, 0.0) / wall, 4)
            self._profiler = None
        self.steps.append(record)


def _timers(timers) -> dict[str, float]:
    """Seconds on each of Megatron's stopped timers since the last read (each read resets it)."""
    out = {}
    for name, timer in getattr(timers, "_timers", {}).items():
        if getattr(timer, "_started", False):  # interval-time runs across steps
            continue
        out[name] = round(timer.elapsed(reset=True), 6)
    return out


def batch_size_schedule(schedule: list[int]) -> str:
    """Megatron-Core's step batch-size schedule ("SAMPLES:BATCH ...") that runs `schedule`, packs per step in order
    (non-decreasing: Megatron's loop only lets the batch grow)."""
    entries, consumed, previous = [], 0, None
    for size in schedule:
        if size != previous:
            entries.append(f"{consumed}:{size}")
            previous = size
        consumed += size
    return " ".join(entries)
