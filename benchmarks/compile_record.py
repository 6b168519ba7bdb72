"""What `torch.compile` did during a benchmark run: the graphs Dynamo made, its graph breaks and its recompile-limit
hits.

The step census counts each compiled region as the one graph Inductor makes of it (benchmarks.compiled_regions). On
a GPU a region can still break (a function Dynamo may not trace, as fla's l2norm was inside Megatron-Core's Gated
DeltaNet input preparation) or recompile until Dynamo's limit (8 per code object), after which it runs eagerly for
the rest of the process with one warning in the log. A run's figures then differ from the census's for a reason no
timing shows. `CompileRecord` around a run keeps those facts with its figures (`bench_train.json`, each run's
"compiles"): the limit hits from Dynamo's counters, and the functions they hit from its warning where the log
reaches the record (a process that reconfigures torch's loggers may keep it from doing so).
"""

from __future__ import annotations

import logging
from collections import Counter

# Dynamo's warning when a code object passes its recompile limit, and its reason among the unsupported cases it counts
# (torch/_dynamo/convert_frame.py)
LIMIT_WARNING = "torch._dynamo hit config."
LIMIT_REASON = "Dynamo recompile limit exceeded"
DYNAMO_LOGGER = "torch._dynamo"
KEPT = 20  # graph-break reasons kept, the most frequent first


class _LimitHits(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(LIMIT_WARNING):
            self.hits.append(" ".join(line.strip() for line in message.splitlines()[:2]))


class CompileRecord:
    """Dynamo's counters and recompile-limit warnings over a block: `summary()` after it."""

    def __enter__(self) -> CompileRecord:
        from torch._dynamo.utils import counters  # Dynamo imported with the run, not with this module

        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = Counter(counters["graph_break"])
        self._unsupported = Counter(counters["unimplemented"])
        self._handler = _LimitHits()
        logging.getLogger(DYNAMO_LOGGER).addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.utils import counters

        logging.getLogger(DYNAMO_LOGGER).removeHandler(self._handler)
        self.graphs = counters["stats"]["unique_graphs"] - self._graphs
        self.breaks = Counter(counters["graph_break"]) - self._breaks
        self.unsupported = Counter(counters["unimplemented"]) - self._unsupported

    def summary(self) -> dict:
        """Graphs made, graph breaks by reason (its first two lines), recompile-limit hits and the functions hit."""
        breaks = Counter()
        for reason, count in self.breaks.items():
            breaks[" ".join(line.strip() for line in reason.strip().splitlines()[:2])[:300]] += count
        return {
            "graphs": self.graphs,
            "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": dict(breaks.most_common(KEPT)),
            "recompile_limit_hits": sum(n for reason, n in self.unsupported.items() if reason.startswith(LIMIT_REASON)),
            "recompile_limit_functions": self._handler.hits,
        }
