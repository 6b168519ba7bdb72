"""Where a profiled training step's time goes, by kind of work: GEMM, attention, elementwise, optimizer, other and
GPU idle, for `bench_train.json` (benchmarks/train_run.py records it over the two steps after a packed run's
measured ones).

Two steps, two profilers, because recording the host's ops slows the host: the first step is recorded with the
device's activity only (CUPTI's kernel, copy and set intervals; their union is the GPU's busy time, the step's wall
time minus it the time the GPU sat idle, as benchmarks/bench_idle.py measures it); the second with the host's ops
too, which tie every kernel to the op that launched it: kernels launched inside torch's `Optimizer.step` (AdamW)
count as optimizer, the others by kernel name (`classify`). That step also writes the usual top-ops table
(profile.txt). Megatron's gradient norm and its main-to-model copies run outside `Optimizer.step` and count as
elementwise.

Without CUDA (the tiny CPU run of the suite) the same code runs over the host's ops (their self time, by op name):
the harness is checked, no figure is taken.
"""

from __future__ import annotations

import re
import time

import torch

from benchmarks.step_anatomy import busy_seconds, device_intervals

CATEGORIES = ("gemm", "attention", "elementwise", "optimizer", "other")
_PATTERNS = (  # first match wins; anything else is elementwise
    ("other", re.compile(r"memcpy|memset|nccl|Memcpy|Memset", re.IGNORECASE)),
    ("optimizer", re.compile(r"adam", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|attn", re.IGNORECASE)),
    (
        "gemm",
        re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|aten::(?:add)?mm$|aten::bmm$|aten::baddbmm$", re.IGNORECASE),
    ),
)
OPTIMIZER_RANGE = "Optimizer.step"


def classify(name: str) -> str:
    """The category of a kernel (or, on CPU, an op) by its name."""
    return next((category for category, pattern in _PATTERNS if pattern.search(name)), "elementwise")


def _in_optimizer(event) -> bool:
    parent = event
    while parent is not None:
        if parent.name.startswith(OPTIMIZER_RANGE):
            return True
        parent = parent.cpu_parent
    return False


def category_seconds(events, cuda: bool) -> dict[str, float]:
    """Seconds of work per category in a profiler's events: each kernel's duration under the op that launched it
    (CUDA), or each op's self time (CPU)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_async:
            continue
        optimizer = _in_optimizer(event)
        if cuda:
            for kernel in event.kernels:
                seconds["optimizer" if optimizer else classify(kernel.name)] += kernel.duration / 1e6
        elif not event.is_user_annotation:
            seconds["optimizer" if optimizer else classify(event.name)] += event.self_cpu_time_total / 1e6
    return seconds


class StepBreakdown:
    """Training callbacks (Megatron-Bridge's CallbackManager) over steps `first` (device activity: busy and idle)
    and `first + 1` (host ops too: categories and the top-ops table written to `table_path`)."""

    def __init__(self, table_path, first: int):
        self.table_path, self.first = table_path, first
        self.cuda = torch.cuda.is_available()
        self.profiler: torch.profiler.profile | None = None
        self.start = 0.0
        self.result: dict = {}

    def step_start(self, context) -> None:
        step = context.state.train_state.step + 1
        if step not in (self.first, self.first + 1):
            return
        activities = [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
        if step == self.first + 1 or not self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.start = time.perf_counter()

    def step_end(self, context) -> None:
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        self.profiler.stop()
        step = context.state.train_state.step + 1  # not advanced yet at the step's end callbacks
        if step == self.first:
            self._busy(wall)
        else:
            self._categories(wall, step)
        self.profiler = None

    def _busy(self, wall: float) -> None:
        if self.cuda:
            intervals = device_intervals(self.profiler)
            self.result["device_events"] = len(intervals)
            if not intervals:  # CUPTI recorded nothing (a profiler and graph problem, not an idle GPU)
                self.result |= {"busy_step": self.first, "step_s": round(wall, 4), "gpu_busy_s": None,
                                "gpu_idle_s": None, "gpu_idle_share": None,
                                "profile_problem": f"the profiler recorded no device activity in step {self.first}: "
                                                   "idle and shares unknown"}  # fmt: skip
                return
            busy = busy_seconds(intervals)
        else:
            busy = sum(category_seconds(self.profiler.events(), cuda=False).values())
        self.result |= {"busy_step": self.first, "step_s": round(wall, 4), "gpu_busy_s": round(min(busy, wall), 4),
                        "gpu_idle_s": round(max(wall - busy, 0.0), 4),
                        "gpu_idle_share": round(max(wall - busy, 0.0) / wall, 4)}  # fmt: skip

    def _categories(self, wall: float, step: int) -> None:
        events = self.profiler.events()
        seconds = category_seconds(events, cuda=self.cuda)
        work = sum(seconds.values())
        self.result |= {
            "categories_step": step,
            "categories_step_s": round(wall, 4),
            "work_s": {name: round(value, 4) for name, value in seconds.items()},
            "work_share": {name: round(value / work, 4) if work else 0.0 for name, value in seconds.items()},
            "device": "cuda kernels" if self.cuda else "cpu ops (harness check: no device)",
        }
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        self.table_path.write_text(
            f"steps {self.first}-{step} (step {self.first}: device activity only; step {step}: host ops too), "
            f"sorted by {sort}, step {step} only\n"
            + events.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
        )

    def summary(self) -> dict:
        """The step's breakdown: idle and busy (first step), work by category (second), shares of the step."""
        if "work_s" not in self.result or "step_s" not in self.result:
            return self.result
        busy, idle = self.result["gpu_busy_s"], self.result["gpu_idle_s"]
        if busy is None or not sum(self.result["work_s"].values()):  # nothing recorded: no shares rather than 0s
            problem = self.result.get("profile_problem") or "the profiler attributed no work to any category"
            return self.result | {"share_of_step": None, "profile_problem": problem}
        step = busy + idle
        shares = {name: round(self.result["work_share"][name] * busy / step, 4) for name in CATEGORIES}
        return self.result | {"share_of_step": shares | {"idle": round(idle / step, 4)}}
