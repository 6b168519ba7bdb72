"""Training benchmark at real model shapes: `python -m benchmarks.bench_train --model qwen2_5_vl_3b` (`make bench-train`).

It builds a real-shape model from the published HF config with random weights (no download; `--layers K` cuts the
language model's depth, the vision tower stays whole), writes a LLaVA-like synthetic dataset (JPEG images at
LLaVA-665k's resolutions, log-normal text, ~8% text-only, ~5% multi-image), packs it with `qvl data prepare` at each
pack length (a DP plan for one GPU), and trains the model's pretrain recipe through Megatron-Bridge's own
`pretrain()` with the patch groups `qvl train` applies on this device (qvl.kernels.switch), each run in its own
process. The runs (`--variants`, benchmarks/train_variants.py; on a GPU by default 4k packed and padded, 8k packed,
4k with `compile=true`, 4k with the CUDA graphs left off):
- packed: the planned-pack loader (worker processes, prefetch), one pack per micro-batch;
- padded: the same samples, one per micro-batch, padded to the longest sample (no packing).

It writes `bench_train.json`: per run (`variants`) tokens/s/GPU, TFLOP/s and MFU by Megatron-Bridge's formula
(vision term included), by qvl's cost model (qvl.foundation.cost, what the DP planner balances) and by the 6N rule;
peak GPU memory next to `qvl plan`'s estimate for the same config and the measured workload; the fraction of step
time spent waiting for data; the losses; the patch groups decided, applied around the loop and in place during step
1 (`patch_groups`, whether the layers ran as CUDA graphs); with `--profile`, two more steps of each base packed run
broken down into GEMM, attention, elementwise, optimizer, other and GPU idle (benchmarks/profile_breakdown.py). Then
`runs` (each length's base packed and padded runs, their tokens/s ratio), `comparisons` (tokens/s ratios of runs
that differ in one thing), `patch_groups` of the base 4k run, the loader's packs/s in one process and with workers
against the packs/s a step consumes, and `checks` against the goals.

`--model tiny` runs the same harness with the tiny random Qwen2.5-VL on CPU (the test suite does, so it never rots);
real shapes need a CUDA GPU. Step 1 (allocator warm-up, kernel selection) is left out of every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from benchmarks import train_run, train_variants
from benchmarks.bench_data import RESOLUTIONS
from benchmarks.train_variants import Variant

logger = logging.getLogger(__name__)

# --model -> (pretrain recipe, family, published size); "tiny" is the tiny random model of qvl.bridges.tiny_model.
MODELS = {
    "tiny": ("qwen2_5_vl_3b_pretrain", "qwen2_5_vl", None),
    "tiny_qwen3_vl": ("qwen3_vl_2b_pretrain", "qwen3_vl", None),  # Megatron-Bridge's vision tower (a gpu test)
    "tiny_qwen3_vl_moe": ("qwen3_vl_30b_a3b_pretrain", "qwen3_vl_moe", None),  # MoE layers' graphs (gpu tests)
    "tiny_qwen3_5_vl": ("qwen3_5_vl_9b_pretrain", "qwen3_5_vl", None),  # Gated DeltaNet layers on fla (gpu test)
    "qwen2_vl_2b": ("qwen2_vl_2b_pretrain", "qwen2_vl", "2b"),
    "qwen2_5_vl_3b": ("qwen2_5_vl_3b_pretrain", "qwen2_5_vl", "3b"),
    "qwen3_vl_2b": ("qwen3_vl_2b_pretrain", "qwen3_vl", "2b"),
    "qwen3_vl_4b": ("qwen3_vl_4b_pretrain", "qwen3_vl", "4b"),
}
WORDS = (
    "the image shows a person dog cat car street table window tree sky building red blue green small large "
    "left right next to on under holding sitting standing what is how many where why color number of in picture "
    "describe detail answer question two three people there are this that with near background foreground"
).split()


@dataclass(kw_only=True, slots=True)
class Setup:
    """One benchmark invocation."""

    model: str
    layers: int | None
    variants: tuple[Variant, ...]  # the runs (benchmarks/train_variants.py)
    steps: int
    global_batch_size: int
    samples: int
    num_workers: int
    out: pathlib.Path
    options: dict[str, object] = field(default_factory=dict)  # recipe options of every run (`--set KEY=VALUE`)
    profile: bool = False  # profile two extra steps of each base packed run (benchmarks/profile_breakdown.py)
    loader_only: bool = False  # no training: the loader's packs/s against what `qvl plan` says an H100 step needs
    loader: bool = True  # after training: the loader's packs/s with and without workers

    @property
    def seq_lengths(self) -> tuple[int, ...]:
        """The pack lengths the runs need datasets for."""
        return tuple(sorted({v.seq_length for v in self.variants}))


# --- inputs: model directory and dataset --------------------------------------------------------------------------


def is_tiny(model: str) -> bool:
    """Whether `--model` is one of the tiny random models (no published size)."""
    return MODELS[model][2] is None


def write_model_dir(path: pathlib.Path, model: str, layers: int | None) -> pathlib.Path:
    """An HF directory with the model's config.json (real shape, or the tiny model with weights), the tiny tokenizer
    (its special-token ids are written into the config) and a processor with the family's real pixel budget."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation.families import TINY_TOKEN_IDS, get_family
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir
    from qvl.recipes.architectures import get_architecture, hf_config

    _, family, size = MODELS[model]
    if size is None:
        return write_tiny_hf_checkpoint(path, family)
    arch = get_architecture(family, size)
    config = hf_config(arch, **({"num_hidden_layers": layers} if layers else {}))
    for name, value in TINY_TOKEN_IDS.items():
        setattr(config, name, value)
    config.save_pretrained(path)
    write_tiny_hf_processor_dir(path, family)
    record = get_family(family)
    unit = record.patch_size * 2  # one LM image token is a 2 x 2 merge of patches
    processor = json.loads((path / "preprocessor_config.json").read_text())
    processor["size"] = {"shortest_edge": 4 * unit * unit, "longest_edge": 1280 * unit * unit}  # Qwen's defaults
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def write_llava_like(root: pathlib.Path, count: int, *, scale: float = 1.0, seed: int = 0) -> tuple[pathlib.Path, ...]:
    """`count` LLaVA-like conversations about random JPEG images; `scale` shrinks the images (CPU tests)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        kind = rng.choice(3, p=[0.08, 0.87, 0.05])
        n_images = [0, 1, int(rng.integers(2, 4))][kind]
        images = []
        for k in range(n_images):
            height, width = (max(int(d * scale), 32) for d in RESOLUTIONS[rng.integers(len(RESOLUTIONS))])
            pixels = rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)  # smooth-ish, JPEG-like size
            name = f"{index:06d}_{k}.jpg"
            Image.fromarray(pixels).resize((width, height)).save(media / name, quality=90)
            images.append(name)
        words = lambda: " ".join(rng.choice(WORDS, size=int(np.clip(rng.lognormal(3.5, 0.8), 3, 600))))
        turns = [{"from": "human", "value": "<image>\n" * n_images + words()}, {"from": "gpt", "value": words()}]
        records.append(json.dumps({"id": f"s{index}", "conversations": turns} | ({"image": images} if images else {})))
    jsonl = root / "data.jsonl"
    jsonl.write_text("\n".join(records) + "\n")
    return jsonl, media


def prepare_dataset(setup: Setup, hf_path: pathlib.Path, jsonl, media, seq_length: int) -> pathlib.Path:
    """`qvl data prepare` with a one-GPU DP plan of `global_batch_size` packs per step."""
    from qvl.data.prepare import PrepareConfig, prepare

    _, family, _ = MODELS[setup.model]
    output = setup.out / f"data-{seq_length}"
    prepare(
        PrepareConfig(
            input=jsonl,
            media_root=media,
            family=family,
            hf_path=hf_path,
            seq_length=seq_length,
            output=output,
            truncate=True,
            data_parallel=1,
            global_batch_size=setup.global_batch_size,
            model_config=hf_path,
        )
    )
    return output


# --- the loader's throughput ---------------------------------------------------------------------------------------


def loader_packs_per_second(data: pathlib.Path, hf_path: pathlib.Path, family: str, workers: int, count: int) -> float:
    """Packs/s the planned loader delivers with `workers` worker processes (0: in the training process), after the
    first micro-batch (worker start-up is a one-off)."""
    from qvl.data.encode import QwenVLPackedTaskEncoder
    from qvl.data.planned import PlannedPackLoader

    plan = json.loads((data / "report.json").read_text())["dp_plan"]
    encoder = QwenVLPackedTaskEncoder(hf_path=hf_path, family=family)
    loader = PlannedPackLoader(
        data,
        encoder,
        rank=0,
        data_parallel=1,
        global_batch_size=plan["global_batch_size"],
        num_workers=workers,
        prefetch=4,
    )
    next(loader)
    if workers:
        time.sleep(2.0)  # the prefetch queue may fill as it would during the first training step; it is
        # bounded (workers x prefetch), so a long run measures the workers' steady rate, as below
    start = time.perf_counter()
    for _ in range(count):
        next(loader)
    elapsed = time.perf_counter() - start
    loader.close()
    return count / elapsed


def variant_spec(
    setup: Setup, hf_path: pathlib.Path, data: pathlib.Path, seq_length: int, mode: str, variant: Variant | None = None
) -> pathlib.Path:
    """Write the spec of one training run (packed, or padded to the longest sample; `variant`'s options, groups left
    off and steps) and return its path."""
    variant = variant or Variant(seq_length=seq_length, mode=mode)
    recipe, _, _ = MODELS[setup.model]
    rows = [json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines()]
    longest = max(max(r["lengths"]) for r in rows)
    samples_per_pack = float(np.mean([len(r["samples"]) for r in rows]))
    # The padded run's step holds about as many samples as a packed step, one per micro-batch.
    global_batch_size = (
        setup.global_batch_size if mode == "packed" else max(round(setup.global_batch_size * samples_per_pack), 1)
    )
    run_dir = setup.out / f"run-{variant.name}"
    profiled = setup.profile and mode == "packed" and variant.base
    spec = {
        "recipe": recipe,
        "tiny": is_tiny(setup.model),
        "mode": mode,
        "pad_to": longest,
        "num_workers": setup.num_workers,
        "profile": profiled,
        "groups_off": list(variant.groups_off),
        # real shapes: the run's plan on its GPU chooses its vision recompute, unless an option sets it
        "vision_recompute_from_plan": not is_tiny(setup.model)
        and not {"vision_recompute", "vision_recompute_blocks"} & {*setup.options, *dict(variant.options)},
        "run_dir": str(run_dir),
        "result": str(run_dir / "result.json"),
        "overrides": {
            "data": str(data),
            "hf_path": str(hf_path),
            "seq_length": seq_length if mode == "packed" else longest,
            "train_iters": (variant.steps or setup.steps) + (train_run.PROFILED_STEPS if profiled else 0),
            "global_batch_size": global_batch_size,
            "micro_batch_size": 1,
            "warmup_iters": 1,
            "save_interval": 10**6,
            "log_interval": 10**6,
            "cuda_graphs": True,  # every speed group on (on the CPU the graphs are recorded: the graphed step checked)
            **setup.options,
            **dict(variant.options),
        },
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    return run_dir / "spec.json"


def train_all(
    setup: Setup, specs: list[pathlib.Path], on_result: Callable[[int, dict], None] | None = None
) -> list[dict]:
    """Train the specs in child processes (Megatron state stays out of this one), and on a GPU each in its own: a
    finished pretrain() leaves its model and optimizer allocated (an H100 run measured the next run's peak on top
    of the last one's ~34 GiB, and a third run failed to allocate its gradient buffer). After a failed run, or a
    process that dies (its run's result an error), the rest go to a fresh process; all write into train_log.txt as
    they run. `on_result(index, result)` is called as each run's result arrives, in order."""
    log, results = setup.out / "train_log.txt", [pathlib.Path(json.loads(p.read_text())["result"]) for p in specs]
    log.write_text("")
    for result in results:
        result.unlink(missing_ok=True)
    per_process = 1 if torch.cuda.is_available() else len(specs)  # the tiny CPU runs share one (imports cost)
    while pending := [spec for spec, result in zip(specs, results, strict=True) if not result.is_file()]:
        command = [sys.executable, "-m", "benchmarks.bench_train", "--worker", *map(str, pending[:per_process])]
        with log.open("a") as f:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=pathlib.Path(__file__).parents[1])
        first = results[specs.index(pending[0])]
        if not first.is_file():  # the process died in its first run: that run's error, the rest go on
            logger.error("a training process ended with exit %s before its run's result; see %s", done.returncode, log)
            first.write_text(json.dumps({"error": f"the run's process ended with exit {done.returncode} "
                                         f"before its result (see {log.name})"}))  # fmt: skip
        for index in range(len(specs) - len(pending), len(specs)):
            if on_result is not None and results[index].is_file():
                on_result(index, json.loads(results[index].read_text()))
    return [json.loads(result.read_text()) for result in results]


def benchmark(setup: Setup) -> dict:
    """Prepare, train every variant, and summarise; writes OUT/bench_train.json."""
    _, family, _ = MODELS[setup.model]
    if not is_tiny(setup.model) and not torch.cuda.is_available() and not setup.loader_only:
        raise SystemExit(
            f"--model {setup.model} needs a CUDA GPU to train (real shapes); on CPU use --model tiny, or --loader-only"
        )
    setup.out.mkdir(parents=True, exist_ok=True)
    hf_path = write_model_dir(setup.out / "hf", setup.model, setup.layers)
    jsonl, media = write_llava_like(setup.out / "samples", setup.samples, scale=0.25 if is_tiny(setup.model) else 1.0)
    kind, peak = train_run.gpu_kind()
    results: dict = {
        "model": setup.model,
        "layers": setup.layers,
        "options": setup.options,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpu_kind": kind,
        "steps": setup.steps,
        "warmup_steps_excluded": train_run.WARMUP_STEPS,
        "num_workers": setup.num_workers,
        "variants": [],
        "runs": [],
        "loader": [],
    }
    datasets = {n: prepare_dataset(setup, hf_path, jsonl, media, n) for n in setup.seq_lengths}
    if setup.loader_only:
        for seq_length, data in datasets.items():
            needed = planned_packs_per_second(setup, hf_path, data, seq_length)
            results["loader"].append(loader_row(data, hf_path, family, setup, needed, what="h100_step_needs_planned"))
        results["checks"] = train_variants.checks(results)
        (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))
        return results
    specs = [variant_spec(setup, hf_path, datasets[v.seq_length], v.seq_length, v.mode, v) for v in setup.variants]

    def done(index: int, result: dict) -> None:  # written as each run ends: a time limit keeps the runs done
        variant = setup.variants[index]
        results["variants"].append({"name": variant.name, "seq_length": variant.seq_length, "mode": variant.mode,
                                    "base": variant.base, "options": dict(variant.options),
                                    "groups_off": list(variant.groups_off), "result": result})  # fmt: skip
        train_variants.summarize(results)
        (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))

    train_all(setup, specs, on_result=done)
    for run in results["runs"] if setup.loader else []:  # after the training figures are written
        if "packed" in run:
            consumed = run["packed"].get("packs_per_s_consumed")
            results["loader"].append(loader_row(datasets[run["seq_length"]], hf_path, family, setup, consumed))
    results["checks"] = train_variants.checks(results)
    (setup.out / "bench_train.json").write_text(json.dumps(results, indent=2))
    return results


def planned_packs_per_second(setup: Setup, hf_path: pathlib.Path, data: pathlib.Path, seq_length: int) -> float:
    """Packs/s one H100 consumes by `qvl plan`'s step-time estimate for this model, packs and dataset."""
    from qvl.foundation import megatron
    from qvl.recipes.planner import plan_config
    from qvl.recipes.split import Workload
    from qvl.training.loop import TrainRequest, prepare_config

    megatron.import_megatron_bridge()
    spec = json.loads(variant_spec(setup, hf_path, data, seq_length, "packed").read_text())
    request = TrainRequest(recipe=spec["recipe"], overrides=spec["overrides"], run_dir=pathlib.Path(spec["run_dir"]))
    config = prepare_config(request, cpu=False)[1]
    rows = [json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines()]
    sample_tokens = int(np.mean([n for r in rows for n in r["lengths"]]))
    plan = plan_config(
        config, gpus=1, gpu="h100", workload=Workload(seq_length=seq_length, sample_tokens=sample_tokens)
    )
    return round(setup.global_batch_size / plan.step_time_s, 2)


def loader_row(data, hf_path, family, setup: Setup, consumed: float, what: str = "consumed") -> dict:
    """Packs/s of the planned loader in one process and with workers, against the packs/s training consumes."""
    count = 8 if is_tiny(setup.model) else 24
    row = {"seq_length": int(json.loads((data / "report.json").read_text())["seq_length"]), what: consumed}
    for workers in sorted({0, setup.num_workers or 2}):
        row[f"workers_{workers}"] = round(loader_packs_per_second(data, hf_path, family, workers, count), 2)
    return row


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the tiny model on CPU (or quick), else Qwen2.5-VL-3B shapes at 4k and 8k on the GPU."""
    tiny = quick or not torch.cuda.is_available()
    setup = default_setup("tiny" if tiny else "qwen2_5_vl_3b", out_dir / "bench_train")
    results = benchmark(setup)
    if tiny and not quick:
        results["why"] = "no CUDA GPU: the tiny model on CPU (harness check, not a speed figure)"
    (out_dir / "bench_train.json").write_text(json.dumps(results, indent=2))
    return results


def default_setup(model: str, out: pathlib.Path, **overrides) -> Setup:
    """Sizes per model: the tiny CPU run is seconds; real shapes train 8 packs per step (6 steps unless a run says
    otherwise), the runs of
    `train_variants.REAL_SHAPES` (4k packed and padded, 8k packed, compile on, CUDA graphs off)."""
    if is_tiny(model):
        variants = tuple(map(train_variants.parse, train_variants.TINY))
        base = dict(variants=variants, steps=3, global_batch_size=2, samples=40, num_workers=2, layers=None)
    else:
        # 12 of Qwen2.5-VL-3B's 36 LM layers (real widths, whole ViT); the full depth's Adam state alone does not fit
        # one 80 GB GPU. Each run recomputes as few vision blocks as its plan on this GPU needs
        # (train_plan.vision_recompute_from_plan; recomputing adds a third to the tower's GEMMs): before the speed
        # groups an H100 ran out of memory at 4k without vision recompute (benchmarks/RESULTS.md). An error, say out
        # of memory at 8k, is recorded as the run's result. `--set vision_recompute=...` decides for every run.
        variants = tuple(map(train_variants.parse, train_variants.REAL_SHAPES))
        base = dict(variants=variants, steps=6, global_batch_size=8, samples=1000, num_workers=4, layers=12)
    options = overrides.pop("options", None) or {}
    setup = Setup(model=model, out=out, **{**base, **{k: v for k, v in overrides.items() if v is not None}})
    setup.options = {**setup.options, **options}
    return setup


def main(argv: list[str] | None = None) -> int:
    """The command line (`make bench-train`); prints the JSON path and a one-line summary per run."""
    from qvl.recipes.overrides import parse_value, split_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=list(MODELS), default="tiny" if not torch.cuda.is_available() else "qwen2_5_vl_3b"
    )
    parser.add_argument("--layers", type=int, help="cut the language model to K layers (the ViT stays whole)")
    parser.add_argument(
        "--variants", nargs="+", type=_variant, metavar="SEQ:MODE[:KEY=VALUE][:-GROUP][:steps=N]",
        help="the runs (benchmarks/train_variants.py; default: its REAL_SHAPES on a GPU, TINY with --model tiny)",
    )  # fmt: skip
    parser.add_argument(
        "--seq-length", type=int, nargs="+", dest="seq_lengths", help="pack lengths: packed and padded runs of each"
    )
    parser.add_argument("--steps", type=int, help="training steps per run (the first is warm-up, left out)")
    parser.add_argument("--global-batch-size", type=int, help="packs per step")
    parser.add_argument("--samples", type=int, help="synthetic conversations to prepare")
    parser.add_argument("--num-workers", type=int, help="loader worker processes")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="recipe options, e.g. vision_recompute=true"
    )
    parser.add_argument("--no-padded", action="store_true", help="with --seq-length: skip the padded runs")
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler over two extra steps of each base packed run"
    )
    parser.add_argument(
        "--loader-only", action="store_true", help="no training (CPU): loader packs/s vs the planner's H100 step"
    )
    parser.add_argument("--no-loader", action="store_true", help="skip the loader's packs/s after training")
    parser.add_argument(
        "--rehearse", action="store_true",
        help="on a CPU: each run's config at its real shapes, then the runs trained at tiny shapes (gpu.sh rehearse)",
    )  # fmt: skip
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench/train"))
    parser.add_argument("--worker", type=pathlib.Path, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return train_run.worker(args.worker)
    options = {k: getattr(args, k) for k in ("layers", "steps", "global_batch_size", "samples", "num_workers")}
    options["variants"] = cli_variants(args)
    setup = default_setup(args.model, args.out, **options)
    setup.loader_only, setup.profile, setup.loader = args.loader_only, args.profile, not args.no_loader
    setup.options |= {key: parse_value(value) for key, value in map(split_pair, args.set)}
    if args.rehearse:
        return rehearse(setup)
    results = benchmark(setup)
    for row in results["loader"]:
        print(f"loader {row}")
    for variant in results["variants"]:
        r = variant["result"]
        if "error" in r:
            print(f"{results['model']} {variant['name']}: FAILED {r['error'][:300]}")
        else:
            print(f"{results['model']} {variant['name']}: {r['tokens_per_s_per_gpu']} tokens/s/GPU, "
                  f"MFU {r['mfu_megatron_bridge']} (Bridge) {r['mfu_six_n']} (6N), data wait {r['data_wait_fraction']}, "
                  f"peak {r['peak_memory_gib']} GiB, idle {(r.get('profile', {}).get('share_of_step') or {}).get('idle')}, "
                  f"graph breaks {r.get('compiles', {}).get('graph_breaks')}, "
                  f"recompile-limit hits {r.get('compiles', {}).get('recompile_limit_hits')}")  # fmt: skip
    for row in results.get("comparisons", []):
        losses = row.get("loss_max_relative_difference")
        print(f"{row['figure']}: {row['value']}" + ("" if losses is None else f" (losses differ by <= {losses})"))
    print(f"wrote {args.out / 'bench_train.json'}")
    return 0


def _variant(text: str) -> Variant:
    try:
        return train_variants.parse(text)
    except ValueError as error:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(error)) from None


def cli_variants(args: argparse.Namespace) -> tuple[Variant, ...] | None:
    """The runs the command line asks for: --variants, or packed (and padded) runs at each --seq-length."""
    if args.variants:
        return tuple(args.variants)
    if args.seq_lengths:
        modes = ("packed",) if args.no_padded else train_variants.MODES
        return tuple(Variant(seq_length=n, mode=mode) for n in args.seq_lengths for mode in modes)
    return None


def rehearse(setup: Setup) -> int:
    """What a GPU call's training stage does before it trains, on a CPU (`gpu.sh rehearse`): each run's config built
    at its real shapes from a few real-resolution samples (recipe options, groups left off, the dataset against the
    recipe), then every run trained for two steps at tiny shapes (the tiny model, packs of a sixteenth of the length)."""
    real = dataclasses.replace(setup, out=setup.out / "real", samples=12)
    real.out.mkdir(parents=True, exist_ok=True)
    hf_path = write_model_dir(real.out / "hf", real.model, real.layers)
    jsonl, media = write_llava_like(real.out / "samples", real.samples, scale=0.25 if is_tiny(real.model) else 1.0)
    for variant in real.variants:
        data = prepare_dataset(real, hf_path, jsonl, media, variant.seq_length)
        spec = json.loads(variant_spec(real, hf_path, data, variant.seq_length, variant.mode, variant).read_text())
        print(f"{variant.name}: {train_run.check_spec(spec)}")
    tiny = [dataclasses.replace(v, seq_length=max(v.seq_length // 16, 256), steps=2) for v in setup.variants]
    small = default_setup("tiny", setup.out / "tiny", variants=tuple(tiny))
    small.options, small.profile, small.loader = dict(setup.options), setup.profile, False
    results = benchmark(small)
    failed = [v["name"] for v in results["variants"] if "error" in v["result"]]
    print(f"tiny runs: {[v['name'] for v in results['variants']]}; failed: {failed}")
    return 1 if failed or len(results["variants"]) != len(tiny) else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
