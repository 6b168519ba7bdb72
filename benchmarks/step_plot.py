"""The step census as a picture: where each configuration's ESTIMATED step goes (`bench_step.png` beside
`bench_step.json`).

One group of bars per configuration with an estimate: the GPU's terms stacked (GEMMs, attention, the elementwise
bytes, pageable copies), the host's time to launch the step eagerly and, where the census estimates it, with CUDA
graphs. A step takes the longer of its GPU and host bars (plus its host syncs), so a host bar longer than the GPU
one marks a host-bound step. The calibration census ("before") leads, as the model reproduces its measured step.
"""

from __future__ import annotations

import pathlib

from benchmarks.step_model import MEASURED_STEP_S

GPU_TERMS = (  # the step model's GPU terms (benchmarks.step_model.StepTimeModel.estimate), bottom to top
    ("gemm_aligned_s", "GEMM", "#4c72b0"),
    ("gemm_misaligned_s", "GEMM, misaligned", "#8c9fcf"),
    ("attention_s", "attention", "#dd8452"),
    ("elementwise_s", "elementwise bytes", "#55a868"),
    ("pageable_copies_s", "pageable copies", "#c44e52"),
)
HOST = "#7f7f7f"


def rows(results: dict) -> list[tuple[str, dict]]:
    """(label, estimate) of the calibration census and of each configuration the model estimated, in that order."""
    before = f"before (calibration,\nmeasured {MEASURED_STEP_S:.3g} s)"
    found = [(before, results["before"]["estimate"])] if "before" in results else []
    return found + [(name, r["estimate"]) for name, r in results.get("configs", {}).items() if "estimate" in r]


def plot(results: dict, path: pathlib.Path) -> pathlib.Path | None:
    """Write the picture of `results` (bench_step's) to `path`; None where no configuration of the run has an
    estimate (`tiny` has none) or matplotlib is missing (it comes with qvl[test])."""
    if not any("estimate" in result for result in results.get("configs", {}).values()):
        return None
    estimates = rows(results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 1.4 + 0.9 * len(estimates)))
    ticks, labels, legend, right = [], [], set(), 0.0

    def bar(y: float, width: float, left: float, label: str, **style) -> None:
        ax.barh(y, width, left=left, label=None if label in legend else label, **style)
        legend.add(label)

    for i, (name, estimate) in enumerate(reversed(estimates)):
        y = 3.5 * i
        left = 0.0
        for key, label, color in GPU_TERMS:
            bar(y + 1, estimate.get(key, 0.0), left, label, color=color)
            left += estimate.get(key, 0.0)
        bar(y, estimate["host_s"], 0.0, "host, eager", color=HOST)
        if "host_s_graphed" in estimate:
            bar(y - 1, estimate["host_s_graphed"], 0.0, "host, CUDA graphs", color=HOST, hatch="//", alpha=0.6)
        end = max(left, estimate["host_s"])
        right = max(right, end)
        ax.text(end, y + 1, f" step {estimate['estimated_step_s']:.3g} s", va="center", fontsize=8)
        ticks.append(y)
        labels.append(name)
    ax.set_xlim(0, 1.18 * right)  # room for the steps' labels
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("ESTIMATED seconds per step (the step model's, not a measurement)")
    ax.set_title("Step census: the GPU's work and the host's launches per step", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
