"""notebooks/quickstart.ipynb runs top to bottom on CPU inside its work directory: recipe -> config edited in a cell ->
plan -> train in the kernel and through NeMo-Run's run.run on a local executor -> both loss curves plotted."""

from __future__ import annotations

import json
import pathlib
import sys

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_committed_notebook_has_no_outputs():
    """Outputs are produced by the test run, never committed (they hold machine paths and megabytes of PNG)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [(i, cell) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    dirty = [i for i, cell in code_cells if cell.outputs or cell.execution_count]
    assert not dirty, f"code cells {dirty} of {NOTEBOOK.name} have outputs; clear them before committing"


@pytest.fixture
def this_interpreters_kernel(tmp_path, monkeypatch) -> str:
    """A `python3` kernelspec whose argv is this interpreter, found first on JUPYTER_PATH.

    The stock spec says `python`, which jupyter_client maps to sys.executable, but a user-level `python3` spec
    (~/.local/share/jupyter/kernels) would win over it and could run another environment's Python.
    """
    kernels = tmp_path / "jupyter" / "kernels"
    write_kernel_spec(kernels / "python3")
    spec = json.loads((kernels / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable, spec
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "python3"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch, this_interpreters_kernel):
    work = tmp_path / "work"
    monkeypatch.setenv("QVL_NOTEBOOK_DIR", str(work))
    nb = nbformat.read(NOTEBOOK, as_version=4)

    client = NotebookClient(
        nb, timeout=600, kernel_name=this_interpreters_kernel, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jupyter", "work"], "the notebook wrote outside $WORK"

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1, f"expected the inline loss plot, got {len(images)} images"
    assert (work / "losses.png").stat().st_size > 1000

    curves = json.loads((work / "losses.json").read_text())
    for name in ("in_process", "nemo_run"):  # train(config) in the kernel, and run.run on a local executor
        steps, losses = zip(*curves[name], strict=True)
        assert steps == tuple(range(1, 9)), (name, steps)
        assert losses[-1] < losses[0] - 0.3, f"{name}: loss did not fall: {losses}"
    # the same recipe, options and seed through both entry points: the same step (fp32 rounding at most)
    in_process = [loss for _, loss in curves["in_process"]]
    nemo_run = [loss for _, loss in curves["nemo_run"]]
    assert in_process == pytest.approx(nemo_run, rel=1e-5)

    report = json.loads((work / "data" / "report.json").read_text())
    assert report["accepted"] > 0 and report["quarantined"] == 3, report
