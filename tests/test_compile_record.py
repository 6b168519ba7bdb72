"""benchmarks.compile_record: a run's graph breaks and recompile-limit hits are kept with its figures."""

from __future__ import annotations

import torch

from benchmarks.compile_record import CompileRecord


@torch.compiler.disable
def _opaque(x):
    return x + 1


def test_a_graph_break_and_a_recompile_limit_hit_are_recorded():
    torch._dynamo.reset()
    broken = torch.compile(lambda x: _opaque(x * 2) * 3, backend="eager")
    static = torch.compile(lambda x: x.sum(), backend="eager", dynamic=False)
    with CompileRecord() as record, torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        broken(torch.ones(3))
        for size in (1, 2, 3, 4):  # a new static size each call: past the limit of 2 it runs eagerly
            static(torch.ones(size))
    summary = record.summary()
    torch._dynamo.reset()
    assert summary["graph_breaks"] >= 1 and summary["graphs"] >= 2 + 2, summary
    assert any("torch.compiler.disable" in reason for reason in summary["graph_break_reasons"]), summary
    assert summary["recompile_limit_hits"] >= 1, summary
    # the function named where Dynamo's warning reaches the record (a test process may have reconfigured its loggers)
    assert all("recompile_limit" in hit for hit in summary["recompile_limit_functions"]), summary


def test_a_run_that_compiles_nothing_records_nothing():
    with CompileRecord() as record:
        torch.ones(3).sum()
    assert record.summary() == {"graphs": 0, "graph_breaks": 0, "graph_break_reasons": {}, "recompile_limit_hits": 0,
                                "recompile_limit_functions": []}  # fmt: skip
