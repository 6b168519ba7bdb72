"""`qvl demo [--family F]`: the whole pipeline end to end with a tiny model (Qwen2.5-VL by default), on CPU or a GPU.

prepare data -> convert HF to Megatron (+ verify) -> plan -> train (SFT from the converted checkpoint)
-> export to HF -> verify the export against the trained checkpoint; with `--stage dpo` then the stage after SFT
(`preference_stages`: pairs, the reference pass, DPO from the SFT run, its export). Every stage is the `qvl` command a
user would type, run as a subprocess; the summary table says where each artifact is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qvl.data.preference_samples import write_preference_samples
from qvl.data.samples import write_sample_dataset
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES, get_family
from qvl.recipes.registry import all_recipes

FAMILY = "qwen2_5_vl"  # the default; `qvl demo --family F` runs any family record's tiny model


@dataclass(kw_only=True, slots=True, frozen=True)
class DemoRecipes:
    """What the demo trains (the family's smallest SFT recipe, tiny) and plans (its next size, real shape)."""

    family: str
    trained: str  # the recipe trained, tiny
    planned: str  # the recipe planned, real shape
    plan_size: str
    plan_gpus: int


def demo_recipes(family: str) -> DemoRecipes:
    """The family's SFT recipes in size order: the first trains at the tiny size, the second is planned."""
    sft = [info for info in all_recipes() if info.family == family and info.stage == "sft"]
    if not sft:
        raise ConfigError(f"--family {family}: no SFT recipe is registered for it; see `qvl recipes`")
    planned = sft[1] if len(sft) > 1 else sft[0]
    return DemoRecipes(
        family=family,
        trained=sft[0].name,
        planned=planned.name,
        plan_size=planned.size.upper(),
        plan_gpus=planned.gpus or 8,
    )


@dataclass(kw_only=True, slots=True)
class Stage:
    """One demo stage: its name, its qvl arguments, and what it produced."""

    name: str
    args: list[str]
    artifact: Path | None = None
    seconds: float = 0.0
    output: str = field(default="", repr=False)


def _qvl(args: list[str], log: Path) -> str:
    """Run `qvl ARGS` in a fresh interpreter (as a user would), teeing its output into `log`."""
    process = subprocess.run([sys.executable, "-m", "qvl.launchers.cli", *args], capture_output=True, text=True)
    log.write_text(process.stdout + process.stderr)
    if process.returncode != 0:
        tail = "\n".join((process.stdout + process.stderr).splitlines()[-25:])
        raise RuntimeError(f"`qvl {' '.join(args[:3])} ...` failed (exit {process.returncode}); log: {log}\n{tail}")
    return process.stdout


def _stages(out: Path, device: list[str], steps: int, recipes: DemoRecipes) -> list[Stage]:
    hf, data, mega, run, export = out / "hf", out / "data", out / "megatron", out / "train", out / "export"
    samples = out / "samples"
    train = [
        recipes.trained,
        f"data={data}",
        f"hf_path={hf}",
        f"pretrained_checkpoint={mega}",
        f"train_iters={steps}",
        "global_batch_size=2",
        "micro_batch_size=1",
        "seq_length=256",
        "warmup_iters=1",
        "lr=1e-3",
        f"save_interval={steps}",
        "log_interval=1",
    ]
    return [
        Stage(
            name="prepare data",
            args=[
                "data",
                "prepare",
                "--input",
                str(samples / "conversations.jsonl"),
                "--media-root",
                str(samples / "images"),
                "--family",
                recipes.family,
                "--hf-path",
                str(hf),
                "--seq-length",
                "256",
                "--output",
                str(data),
            ],
            artifact=data,
        ),
        Stage(
            name="import HF -> Megatron",
            args=["convert", "import", str(hf), str(mega), "--dtype", "fp32", *device],
            artifact=mega,
        ),
        Stage(
            name="verify conversion",
            args=["convert", "verify", str(hf), str(mega), "--report", str(out / "verify-conversion.json"), *device],
        ),
        Stage(
            name=f"plan ({recipes.plan_size}, {recipes.plan_gpus} x H100)",
            args=["plan", recipes.planned, "--gpus", str(recipes.plan_gpus), "--gpu", "h100", "--json"],
        ),
        Stage(
            name=f"train (SFT, {steps} steps)",
            args=["train", *train, "--model", "tiny", "--run-dir", str(run), *device],
            artifact=run,
        ),
        *export_stages(run, export, out / "verify-export.json", device, what="SFT"),
    ]


def export_stages(run: Path, export: Path, report: Path, device: list[str], *, what: str) -> list[Stage]:
    """A training run exported to HF (the run keeps its HF side) and the export checked against the trained
    checkpoint."""
    verify = ["convert", "verify", str(export), str(run / "checkpoints"), "--report", str(report), *device]
    return [
        Stage(name=f"export {what} -> HF", args=["convert", "export", str(run), str(export), *device], artifact=export),
        Stage(name=f"verify {what} export", args=verify),
    ]


PAIRS = 24  # good pairs of the sample (a few broken ones follow, to show the quarantine)


def dpo_recipe(family: str) -> str:
    """The family's smallest full-model DPO recipe (trained at the tiny size)."""
    return next(info.name for info in all_recipes() if info.family == family and info.stage == "dpo")


def preference_stages(out: Path, device: list[str], steps: int, recipes: DemoRecipes) -> list[Stage]:
    """The DPO stages, from the SFT run in `out/train` (written by the SFT stages before them)."""
    jsonl, media = write_preference_samples(out / "pairs", format="trl", count=PAIRS)
    hf, data, sft, run, export = out / "hf", out / "dpo-data", out / "train", out / "dpo", out / "dpo-export"
    recipe = [
        dpo_recipe(recipes.family),
        f"data={data}",
        f"hf_path={hf}",
        f"pretrained_checkpoint={sft / 'checkpoints'}",
        "seq_length=256",
        "micro_batch_size=1",
    ]
    # a tiny random model moves visibly at a larger LR and beta than published DPO's (5e-7, 0.1)
    training = [f"train_iters={steps}", "global_batch_size=8", "warmup_iters=0", "lr=1e-3", "dpo_beta=0.5",
                f"save_interval={steps}", "log_interval=1"]  # fmt: skip
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", recipes.family, "--hf-path", str(hf)]
    return [
        Stage(
            name="prepare pairs",
            args=["data", "prepare", *prepare, "--seq-length", "256", "--output", str(data)],
            artifact=data,
        ),
        Stage(
            name="reference log-probs",
            args=["reference", *recipe, "--model", "tiny", *device],
            artifact=data / "reference",
        ),
        Stage(
            name=f"train (DPO, {steps} steps)",
            args=["train", *recipe, *training, "--model", "tiny", "--run-dir", str(run), *device],
            artifact=run,
        ),
        *export_stages(run, export, out / "verify-dpo-export.json", device, what="DPO"),
    ]


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint

    # --json: the summary alone on stdout, progress and the table on stderr
    console, out = Console(stderr=args.json), Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = ["--device", "cpu"] if args.device == "cpu" else []
    write_sample_dataset(out / "samples")
    recipes = demo_recipes(args.family)
    write_tiny_hf_checkpoint(out / "hf", recipes.family)
    console.print(f"[bold]qvl demo[/]: tiny {recipes.family} end to end in {out}")
    results: dict = {"output": str(out)}
    stages = _stages(out, device, args.steps, recipes)
    if args.stage == "dpo":  # the stage after SFT, from the SFT run
        stages += preference_stages(out, device, args.steps, recipes)
    for stage in stages:
        console.print(f"[cyan]>[/] {stage.name}: qvl {' '.join(stage.args[:2])} ...")
        started = time.perf_counter()
        stage.output = _qvl(stage.args, out / f"{stage.name.split()[0]}-{len(results)}.log")
        stage.seconds = time.perf_counter() - started
        results[stage.name] = {"seconds": round(stage.seconds, 1), "artifact": str(stage.artifact or "")}
        if stage.name.startswith("verify"):
            results[stage.name]["report"] = json.loads(Path(stage.args[stage.args.index("--report") + 1]).read_text())
        elif stage.args[0] == "plan":
            results[stage.name]["plan"] = plan_summary(json.loads(stage.output))
    if args.stage == "dpo":
        results["dpo"] = read_records(out / "dpo")
        results["pairs"] = json.loads((out / "dpo-data" / "report.json").read_text())
    _summarise(results, out, console, Table)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    return 0 if all(r["report"]["ok"] for k, r in results.items() if k.startswith("verify")) else 1


def plan_summary(plan: dict) -> dict:
    """What the demo keeps of `qvl plan --json`: whether it fits, the fullest stage's GiB per GPU, the layout and the
    MFU estimate."""
    worst = max(plan["stages"], key=lambda stage: stage["total_gib"])
    return {"fits": plan["fits"], "gib_per_gpu": worst["total_gib"], "mfu_estimate": plan["mfu"],
            "layout": plan["layout"], "problems": plan["problems"]}  # fmt: skip


def read_records(run: Path) -> list[dict]:
    """Every step's record of a run's losses.jsonl (a DPO run's carries its rewards), in step order."""
    path = run / "losses.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


def _summarise(results: dict, out: Path, console, table_cls) -> None:
    from qvl.training.loop import read_losses

    data = json.loads((out / "data" / "report.json").read_text())
    losses = read_losses(out / "train")
    results["losses"] = losses
    results["data"] = {
        k: data[k] for k in ("accepted", "quarantined", "packed_sequences", "packing_efficiency") if k in data
    }
    (out / "demo_summary.json").write_text(json.dumps(results, indent=2, default=str))
    _plot_losses(losses, out / "loss.png", get_family(data["family"]).title)
    console.print(summary_table(results, out, data, losses, table_cls))
    console.print(f"summary: {out / 'demo_summary.json'}   loss curve: {out / 'loss.png'}")


def summary_table(results: dict, out: Path, data: dict, losses: dict[int, float], table_cls):
    """The stages as a table that reads at 80 columns: artifacts relative to the output folder, short results."""
    from rich import box

    table = table_cls(
        title=f"qvl demo ({out})", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, title_justify="left"
    )
    table.add_column("stage", no_wrap=True)
    table.add_column("s", justify="right", no_wrap=True)
    table.add_column("result", min_width=27)  # the longest result: a DPO run's losses and reward accuracy
    table.add_column("output", no_wrap=True)
    for name, result in results.items():
        if not isinstance(result, dict) or "seconds" not in result:
            continue
        detail = ""
        if "report" in result:
            r = result["report"]
            detail = f"{'ok' if r['ok'] else 'DIFFER'}, max diff {r['max_abs_diff']:.1g}"
        elif "plan" in result:
            plan = result["plan"]  # it fits: `qvl plan` exits 1 otherwise, and the demo stops there
            detail = f"{plan['gib_per_gpu']:.1f} GiB/GPU, MFU ~{plan['mfu_estimate']:.0%}"
        elif name.startswith("train (DPO") and results.get("dpo"):
            first, last = results["dpo"][0], results["dpo"][-1]
            detail = f"loss {first['loss']:.2f} -> {last['loss']:.2f}, acc {last['reward_accuracy']:.2f}"
        elif name.startswith("train") and losses:
            detail = f"loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f}"
        elif name.startswith("prepare pairs") and results.get("pairs"):
            pairs = results["pairs"]
            detail = f"{pairs['accepted']} kept, {pairs['quarantined']} quarantined"
        elif name.startswith("prepare"):
            detail = f"{data.get('accepted')} kept, {data.get('quarantined')} quarantined"
        artifact = Path(result["artifact"]) if result["artifact"] else None
        shown = f"{artifact.relative_to(out)}/" if artifact and artifact.is_relative_to(out) else str(artifact or "")
        table.add_row(name, f"{result['seconds']:.0f}", detail, shown)
    return table


def _plot_losses(losses: dict[int, float], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib comes with qvl[test]; the demo still works without the picture
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    steps = sorted(losses)
    ax.plot(steps, [losses[s] for s in steps], marker="o")
    ax.set(xlabel="step", ylabel="LM loss", title=f"qvl demo: tiny {title} SFT")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def register(subparsers) -> None:
    """Add `qvl demo`."""
    demo = subparsers.add_parser("demo", help="run the pipeline end to end with a tiny model (CPU or GPU)")
    demo.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--family", choices=list(FAMILIES), default=FAMILY, help=f"model family (default {FAMILY})")
    demo.add_argument("--output", default=".demo", help="where artifacts go (default .demo/)")
    demo.add_argument(
        "--stage",
        choices=("sft", "dpo"),
        default="sft",
        help="sft: the pipeline through SFT (default); dpo: then preference pairs, the reference pass, DPO and its "
        "export",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (progress on stderr)")
    demo.set_defaults(func=run_demo)
