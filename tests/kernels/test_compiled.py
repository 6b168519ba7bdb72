"""qvl's compiled regions (qvl.kernels.compiled): eager on a CPU tensor, compiled where they run, and eager with a
warning from a first failure to compile on."""

from __future__ import annotations

import logging

import pytest
import torch

from qvl.kernels import compiled


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_cpu_tensor_takes_the_eager_function():
    x = torch.ones(3)
    assert not compiled.runs_compiled(x)
    assert compiled.region(_double_plus_one, x) is _double_plus_one


def test_the_region_is_compiled_once_per_function(monkeypatch):
    monkeypatch.setattr(compiled, "runs_compiled", lambda tensor: True)
    compiled.compiled.cache_clear()
    first = compiled.region(_double_plus_one, torch.ones(3))
    assert isinstance(first, compiled.CompiledRegion) and first.fn is _double_plus_one
    assert compiled.region(_double_plus_one, torch.ones(5)) is first
    compiled.compiled.cache_clear()


def test_a_region_that_cannot_compile_runs_eagerly_with_one_warning(caplog):
    region = compiled.CompiledRegion(_double_plus_one)
    attempts = []

    def refuse(*args):
        attempts.append(args)
        raise torch._dynamo.exc.TorchDynamoException("no kernel for this op")

    region.graph = refuse
    x = torch.arange(3.0)
    with caplog.at_level(logging.WARNING, logger="qvl.kernels.compiled"):
        assert torch.equal(region(x), x * 2 + 1)
        assert torch.equal(region(x), x * 2 + 1)
    assert len(attempts) == 1  # not tried again
    (record,) = caplog.records
    assert "_double_plus_one could not be compiled and runs eagerly: no kernel for this op" in record.getMessage()


def test_a_region_past_dynamos_recompile_limit_runs_eagerly(caplog):
    """A full-graph function compiled more often than Dynamo's recompile_limit raises FailOnRecompileLimitHit, a plain
    Exception, where Dynamo would otherwise run the frame eagerly: the region runs eagerly from then on, with its
    warning, instead of stopping the run (Dynamo itself, its eager backend standing in for Inductor)."""
    torch._dynamo.reset()
    region = compiled.CompiledRegion(_double_plus_one)
    region.graph = torch.compile(_double_plus_one, backend="eager", fullgraph=True, dynamic=True)
    x32, x64 = torch.arange(3.0), torch.arange(3.0, dtype=torch.float64)
    try:
        with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, "qvl.kernels.compiled"):
            assert torch.equal(region(x32), x32 * 2 + 1) and not region.eager
            assert torch.equal(region(x64), x64 * 2 + 1)  # a new dtype: a second compile, past the limit
    finally:
        torch._dynamo.reset()
    assert region.eager
    warned = [r.getMessage() for r in caplog.records if r.name == "qvl.kernels.compiled"]
    assert len(warned) == 1 and "_double_plus_one could not be compiled and runs eagerly" in warned[0], warned


def test_inside_a_graph_capture_a_region_runs_its_compiled_code_or_its_eager_ops_and_never_compiles(monkeypatch):
    """Compiling inside a CUDA graph capture would run Triton's autotuning (a synchronisation the capture refuses):
    there the region takes the code compiled before where its guards hold, else the call's ops eagerly; outside a
    capture a new input compiles as before (Dynamo itself, a counting eager backend standing in for Inductor)."""
    torch._dynamo.reset()
    compiles = []

    def backend(graph_module, inputs):
        compiles.append(graph_module)
        return graph_module.forward

    region = compiled.CompiledRegion(_double_plus_one)
    region.graph = torch.compile(_double_plus_one, backend=backend, fullgraph=True, dynamic=True)
    x32, x64 = torch.arange(3.0), torch.arange(3.0, dtype=torch.float64)
    try:
        assert torch.equal(region(x32), x32 * 2 + 1) and len(compiles) == 1
        monkeypatch.setattr(compiled.graph_replay, "is_capturing", lambda: True)
        assert torch.equal(region(torch.arange(5.0)), torch.arange(5.0) * 2 + 1)  # the compiled code: guards hold
        assert torch.equal(region(x64), x64 * 2 + 1) and len(compiles) == 1  # a new dtype: eager, not compiled
        monkeypatch.setattr(compiled.graph_replay, "is_capturing", lambda: False)
        assert torch.equal(region(x64), x64 * 2 + 1) and len(compiles) == 2  # outside a capture it compiles
    finally:
        torch._dynamo.reset()
    assert not region.eager


def test_other_errors_are_not_swallowed():
    region = compiled.CompiledRegion(_double_plus_one)

    def fail(*args):
        raise RuntimeError("CUDA error: an illegal memory access")

    region.graph = fail
    with pytest.raises(RuntimeError, match="illegal memory access"):
        region(torch.ones(2))
    assert not region.eager
