"""`qvl data prepare` end to end at corpus scale: samples/s at 1 and 2 workers and through Ray, peak RSS vs size.

The input is LLaVA-like: ~87% one image, ~8% text only, ~5% two to four images, multi-turn text of log-normal
length, and real encoded JPEGs at COCO / GQA / VG sizes (smooth content plus grain, ~50-200 KB, like photos).
A share of the samples point at images other samples also use (LLaVA reuses COCO images across its sources).
Samples/s "at scale" is the slope between runs at a quarter and all of the distinct-image set (the fastest of
`REPEATS` runs each): what a corpus-sized run sees, without the fixed start-up (imports, tokenizer, Energon's
index) that dominates a few-thousand-sample run on 2 cores. The 2-worker goal is checked on it.
Every run is a fresh subprocess (`python -m qvl.launchers.cli data prepare ...`), so peak RSS is that run's alone
(children included).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys

import numpy as np

from benchmarks.bench_data import RESOLUTIONS

WORDS = (
    "the a an image shows picture of in on with and is are what where how many color red blue green man woman "
    "dog cat street table food sign building sky car train bus people standing sitting holding looking left right "
    "behind front small large white black wooden two three several answer question describe detail please"
).split()
GOALS = {"speedup_2_workers": 1.8, "rss_200k_over_20k": 1.1, "one_core_distinct_over_baseline": 1.5}
REPEATS = 2  # runs per size and worker count; the fastest counts (the other jobs of a 2-core machine add noise)
BASELINE_DISTINCT_SAMPLES_PER_S = 265.0  # qvl 154aea6..f1a38f5 here: 230-300 samples/s end to end, one core


def make_jpeg(path: pathlib.Path, width: int, height: int, rng: np.random.Generator) -> None:
    """A photo-like JPEG: a smooth random field upscaled, plus grain (compresses like a real photo)."""
    from PIL import Image

    small = rng.integers(0, 256, (max(2, height // 40), max(2, width // 40), 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
    grain = rng.normal(0, 6, (height, width, 3))
    pixels = np.clip(np.asarray(image, np.float32) + grain, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG", quality=88)


def _text(rng: np.random.Generator, mean_words: float) -> str:
    n = int(np.clip(rng.lognormal(np.log(mean_words), 0.8), 2, 600))
    return " ".join(rng.choice(WORDS, n)) + "."


def _record(rng: np.random.Generator, images: list[str]) -> dict:
    turns = []
    for turn in range(int(rng.choice([1, 1, 2, 3, 5]))):
        question = _text(rng, 10)
        if turn == 0 and images:
            question = "<image>\n" * len(images) + question
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": _text(rng, 40)}]
    record = {"id": f"s{rng.integers(1 << 40)}", "conversations": turns}
    if images:
        record["image"] = images if len(images) > 1 else images[0]
    return record


def write_llava_like(
    root: pathlib.Path, n_samples: int, *, n_images: int | None = None, shared: float = 0.1, seed: int = 0
) -> tuple[pathlib.Path, pathlib.Path]:
    """n_samples LLaVA-like records as JSONL under root, with their JPEGs; returns (jsonl, media_root).

    `n_images` distinct files are drawn (default: one per image slot, i.e. all distinct); a `shared` fraction of
    image slots reuse an earlier image, as LLaVA's sources reuse COCO images.
    """
    rng = np.random.default_rng(seed)
    media = root / "images"
    media.mkdir(parents=True, exist_ok=True)
    kinds = rng.choice(3, size=n_samples, p=[0.08, 0.87, 0.05])
    counts = np.where(kinds == 0, 0, np.where(kinds == 1, 1, rng.integers(2, 5, n_samples)))
    slots = int(counts.sum())
    pool = n_images if n_images is not None else slots
    for k in range(pool):
        height, width = RESOLUTIONS[k % len(RESOLUTIONS)]
        make_jpeg(media / f"{k:07d}.jpg", width, height, rng)
    choice = np.arange(slots) % pool
    reuse = rng.random(slots) < shared
    choice[reuse] = rng.integers(0, pool, int(reuse.sum()))
    path, cursor = root / "train.jsonl", 0
    with path.open("w") as f:
        for count in counts.tolist():
            names = [f"{k:07d}.jpg" for k in choice[cursor : cursor + count].tolist()]
            cursor += count
            f.write(json.dumps(_record(rng, names)) + "\n")
    return path, media


def run_prepare(
    input_path: pathlib.Path, media: pathlib.Path, hf_path: pathlib.Path, output: pathlib.Path, *extra: str
) -> dict:
    """One `qvl data prepare` in a fresh process: wall time, samples/s and peak RSS (GiB, children included)."""
    shutil.rmtree(output, ignore_errors=True)
    argv = [sys.executable, "-m", "qvl.launchers.cli", "data", "prepare", "--input", str(input_path)]
    argv += ["--media-root", str(media), "--family", "qwen2_5_vl", "--hf-path", str(hf_path)]
    argv += ["--seq-length", "8192", "--output", str(output), "--quiet", *extra]
    script = (
        "import resource, subprocess, sys, json, time\n"
        "t = time.perf_counter(); rc = subprocess.call(sys.argv[1:])\n"
        "print(json.dumps({'rc': rc, 'seconds': time.perf_counter() - t,"
        " 'peak_rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env)
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    if stats["rc"] != 0:
        raise RuntimeError(f"qvl data prepare failed ({stats['rc']}): {done.stderr[-2000:]}")
    report = json.loads((output / "report.json").read_text())
    return {
        "samples": report["read"],
        "accepted": report["accepted"],
        "seconds": round(stats["seconds"], 2),
        "samples_per_s": round(report["read"] / stats["seconds"], 1),
        # ru_maxrss of children is the largest single descendant: the driver here (workers are smaller).
        "peak_rss_gib": round(stats["peak_rss_kib"] / 2**20, 3),
        "time_s": report["time_s"],
    }


def scale_rate(small: list[dict], full: list[dict]) -> dict:
    """Samples/s at scale from runs at two sizes of one input: the slope (extra samples over extra seconds, fastest
    run of each size), and the fixed start-up seconds it leaves (the intercept)."""
    a, b = min(small, key=lambda r: r["seconds"]), min(full, key=lambda r: r["seconds"])
    rate = (b["samples"] - a["samples"]) / max(b["seconds"] - a["seconds"], 1e-9)
    return {"samples_per_s": round(rate, 1), "fixed_start_s": round(a["seconds"] - a["samples"] / rate, 2)}


def _check(figure: str, value: float, goal: float, *, at_most: bool = False) -> dict:
    return {
        "figure": figure,
        "value": value,
        "goal": f"{'<=' if at_most else '>='} {goal}",
        "met": bool(value <= goal if at_most else value >= goal),
    }


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """The prepare benchmark; writes `bench_prepare.json` into out_dir."""
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "prepare-work"
    shutil.rmtree(work, ignore_errors=True)
    hf_path = write_tiny_hf_processor_dir(work / "hf", "qwen2_5_vl")
    n_rate, n_small, n_large = (600, 2_000, 6_000) if quick else (4_000, 20_000, 200_000)
    distinct = write_llava_like(work / "distinct", n_rate, shared=0.0, seed=1)
    # The same images, a quarter of the samples: the runs at both sizes give the rate at scale (the slope) apart
    # from the fixed start-up (imports, tokenizer, Energon's index), which a corpus-sized run does not notice.
    first = work / "distinct" / "first_quarter.jsonl"
    first.write_text("".join(distinct[0].read_text().splitlines(keepends=True)[: n_rate // 4]))
    rates, at_scale = {}, {}
    for workers in ("1", "2"):
        small = [run_prepare(first, distinct[1], hf_path, work / "o", "--workers", workers) for _ in range(REPEATS)]
        full = [run_prepare(*distinct, hf_path, work / "o", "--workers", workers) for _ in range(REPEATS)]
        rates[f"workers_{workers}"] = min(full, key=lambda r: r["seconds"])
        at_scale[f"workers_{workers}"] = scale_rate(small, full)
    try:
        import ray  # noqa: F401

        rates["ray_local_2cpu"] = run_prepare(*distinct, hf_path, work / "or", "--ray", "local:2")
    except ImportError:
        rates["ray_local_2cpu"] = None
    one = rates["workers_1"]["samples_per_s"]
    scale_speedup = at_scale["workers_2"]["samples_per_s"] / at_scale["workers_1"]["samples_per_s"]
    # The memory runs share a pool of images (generating 200k distinct JPEGs takes longer than preparing them).
    memory = {}
    for n in (n_small, n_large):
        data = write_llava_like(work / f"m{n}", n, n_images=2_000, shared=0.1, seed=2)
        memory[f"samples_{n}"] = run_prepare(*data, hf_path, work / f"om{n}", "--workers", "2")
    rss_ratio = memory[f"samples_{n_large}"]["peak_rss_gib"] / memory[f"samples_{n_small}"]["peak_rss_gib"]
    speedup = rates["workers_2"]["samples_per_s"] / one
    results = {
        "quick": quick,
        "cores": os.cpu_count(),
        "distinct_images": rates,
        "at_scale": at_scale,
        "speedup_2_workers_at_scale": round(scale_speedup, 3),
        "memory": memory,
        "speedup_2_workers": round(speedup, 3),
        "rss_large_over_small": round(rss_ratio, 3),
        "llava_665k_hours_per_core": round(665_000 / one / 3600, 3),
        "one_core_over_baseline": round(one / BASELINE_DISTINCT_SAMPLES_PER_S, 3),
        "checks": [
            _check("samples/s at scale (slope), 2 workers / 1", round(scale_speedup, 3), GOALS["speedup_2_workers"]),
            {
                "figure": f"samples/s end to end at {n_rate:,}, 2 workers / 1 (fixed start-up included)",
                "value": round(speedup, 3),
                "goal": "",
                "met": None,
            },  # fmt: skip
            _check(f"peak RSS {n_large:,} / {n_small:,} samples", round(rss_ratio, 3), 1.1, at_most=True),
            _check(
                f"1-core samples/s / {BASELINE_DISTINCT_SAMPLES_PER_S:.0f} (before)",
                round(one / BASELINE_DISTINCT_SAMPLES_PER_S, 3),
                GOALS["one_core_distinct_over_baseline"],
            ),
            {"figure": "LLaVA-665k at 1 core (h)", "value": round(665_000 / one / 3600, 3), "goal": "", "met": None},
        ],
        "max_rss_bench_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if rates["ray_local_2cpu"]:
        ray_rate = rates["ray_local_2cpu"]["samples_per_s"]
        results["checks"].append(
            {"figure": "Ray (local, 2 CPUs) samples/s", "value": ray_rate, "goal": "", "met": None}
        )
    (out_dir / "bench_prepare.json").write_text(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run)
