"""Conversion benchmark: wall time and peak RSS of `qvl convert import` on GB-sized synthetic checkpoints.

The checkpoints have Qwen2.5-VL-3B's widths (hidden 2048, MLP 11008, 16 heads / 2 KV heads, vocabulary
151936, tied embeddings; vision hidden 1280) with fewer layers, filled with random bf16 weights and
sharded like a released checkpoint. Each conversion runs in its own process so its peak RSS is its own.
The constant is the peak RSS of the same command on the tiny Qwen2.5-VL checkpoint (under 2 MB of
weights): interpreter, torch, Megatron-Core, Megatron-Bridge, transformers and the save machinery.

Goal: peak RSS - constant <= 1.5 x the largest shard, flat as depth grows. qvl's import streams
(qvl.bridges.stream: a meta-device model, each tensor converted when the checkpoint writer asks for it and
freed once written); Megatron-Bridge's own import builds the whole model first, and grew by 1.08x the bytes
of each added layer here before qvl streamed.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

GOAL_GROWTH_OVER_LARGEST_SHARD = 1.5
CONVERT_DTYPE = "bf16"
# Qwen2.5-VL-3B's config.json, less depth: the widths that set tensor and shard sizes. head_dim 128.
WIDE_TEXT = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
)
WIDE_VISION = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, window_size=112)
# Half-width, small-vocabulary shape for quick runs and the memory test: ~30 MB per layer, 64 MiB embedding.
MID_TEXT = WIDE_TEXT | dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, vocab_size=32768)
MID_VISION = dict(hidden_size=512, intermediate_size=1024, num_heads=8, out_hidden_size=1024, window_size=112)


@dataclass(kw_only=True, slots=True)
class Sweep:
    """The synthetic checkpoints one run converts: widths, shard size and text depths."""

    name: str
    text: dict
    vision: dict
    shard_bytes: int
    depths: tuple[int, ...]
    vision_depth: int = 4


FULL = Sweep(
    name="Qwen2.5-VL-3B widths, 4 vision blocks, random bf16, tied embeddings",
    text=WIDE_TEXT,
    vision=WIDE_VISION,
    shard_bytes=400 * 2**20,
    depths=(4, 8, 12),
)
QUICK = Sweep(
    name="half width, 32k vocabulary, 4 vision blocks, random bf16, tied embeddings",
    text=MID_TEXT,
    vision=MID_VISION,
    shard_bytes=48 * 2**20,
    depths=(2,),
)


def synthetic_config(
    text_layers: int, *, text: dict = WIDE_TEXT, vision: dict = WIDE_VISION, vision_depth: int = 4
) -> PreTrainedConfig:
    """The tiny Qwen2.5-VL config with `text_layers` decoder layers and the given text and vision widths."""
    from qvl.bridges.tiny_model import tiny_hf_config

    tiny = tiny_hf_config("qwen2_5_vl")
    fields = tiny.to_dict()
    text = fields["text_config"] | text | {"num_hidden_layers": text_layers}
    text.pop("layer_types")  # derived from num_hidden_layers; a stale copy fails validation
    vision = (
        fields["vision_config"]
        | vision
        | {"depth": vision_depth, "fullatt_block_indexes": list(range(1, vision_depth, 2))}
    )
    fields.update(text_config=text, vision_config=vision, tie_word_embeddings=text.get("tie_word_embeddings", False))
    return type(tiny)(**fields)


def hf_layout(config: PreTrainedConfig) -> dict[str, torch.Size]:
    """Name -> shape of every tensor `save_pretrained` writes for `config` (from a meta-device model).

    Tied weights are dropped and names renamed back to the on-disk layout exactly as `save_pretrained`
    does, so the files look like a released checkpoint (`model.layers.*`, `visual.*`).
    """
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    return {name: tensor.shape for name, tensor in state.items()}


def write_random_hf_checkpoint(
    path: pathlib.Path,
    config: PreTrainedConfig,
    *,
    max_shard_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict:
    """Write random weights for `config` as sharded safetensors + index + config + tokenizer; returns sizes.

    Each tensor is a slice of one random pool at a random offset, so GBs take seconds, not HF's init.
    The tokenizer is the tiny test one (512 ids): conversion only copies it.
    """
    from safetensors.torch import save_file

    from qvl.bridges.tiny_model import VOCAB_SIZE
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = hf_layout(config)
    generator = torch.Generator().manual_seed(seed)
    pool = torch.empty(max(s.numel() for s in layout.values()) + 2**24, dtype=dtype).normal_(
        0, 0.02, generator=generator
    )
    shards = shard_names(layout, max_shard_bytes, pool.element_size())
    weight_map, shard_bytes = {}, []
    for index, names in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        offsets = torch.randint(
            0, pool.numel() - max(layout[n].numel() for n in names) + 1, (len(names),), generator=generator
        )
        tensors = {n: pool[o : o + layout[n].numel()].view(layout[n]).clone() for n, o in zip(names, offsets.tolist())}
        save_file(tensors, path / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
        shard_bytes.append((path / filename).stat().st_size)
    total = sum(s.numel() for s in layout.values()) * pool.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = copy.copy(config)
    config.dtype = dtype  # like a released checkpoint's "dtype": "bfloat16"
    config.save_pretrained(path)
    write_tiny_hf_processor_dir(path, "qwen2_5_vl", vocab_size=VOCAB_SIZE)
    return {
        "tensors": len(layout),
        "weight_bytes": total,
        "shards": len(shards),
        "largest_shard_bytes": max(shard_bytes),
    }


def shard_names(layout: dict[str, torch.Size], max_shard_bytes: int, element_size: int) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most max_shard_bytes (a bigger tensor gets its own)."""
    shards, current_bytes = [[]], 0
    for name, shape in layout.items():
        size = shape.numel() * element_size
        if shards[-1] and current_bytes + size > max_shard_bytes:
            shards.append([])
            current_bytes = 0
        shards[-1].append(name)
        current_bytes += size
    return shards


def convert_command(hf_path: pathlib.Path, out_dir: pathlib.Path) -> list[str]:
    """`qvl convert import` at TP=PP=1 on CPU, as a user runs it."""
    return [
        sys.executable,
        "-m",
        "qvl.launchers.commands.convert",
        "import",
        str(hf_path),
        str(out_dir),
        "--dtype",
        CONVERT_DTYPE,
        "--device",
        "cpu",
    ]


def measure_process(command: list[str], *, timeout_s: float = 600) -> dict:
    """Run `command`; its wall time and its own peak RSS, peak anonymous RSS and process-tree peak RSS.

    peak_rss_bytes is the process's own high-water mark (VmHWM, monotonic, so polling cannot miss it).
    Anonymous memory is what it allocated; RSS also counts mapped library and safetensors pages.
    tree_peak_rss_bytes is what `/usr/bin/time -v` reports: the largest of the process and its children
    (Megatron's checkpoint writer spawns a multiprocessing manager). Anonymous RSS is sampled every 50 ms.
    """
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        peaks, done = {"VmHWM": 0, "RssAnon": 0}, threading.Event()
        sampler = threading.Thread(target=_sample_peaks, args=(process.pid, peaks, done), daemon=True)
        sampler.start()
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage, unlike RUSAGE_CHILDREN
        finally:
            timer.cancel()
            done.set()
            sampler.join()
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        log.seek(0)
        output = log.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{output[-3000:]}")
    tree_peak = usage.ru_maxrss * 1024
    return {
        "seconds": round(seconds, 2),
        "peak_rss_bytes": peaks["VmHWM"] or tree_peak,
        "peak_anon_rss_bytes": peaks["RssAnon"],
        "tree_peak_rss_bytes": tree_peak,
    }


def _sample_peaks(pid: int, peaks: dict[str, int], done: threading.Event) -> None:
    status = pathlib.Path(f"/proc/{pid}/status")
    while not done.wait(0.05):
        try:
            text = status.read_text()
        except OSError:  # exited (or no /proc, e.g. macOS: then only the tree peak is reported)
            return
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in peaks:
                peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)


def baseline(work: pathlib.Path) -> dict:
    """The constant: the same command on the tiny Qwen2.5-VL checkpoint."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint

    hf_path = write_tiny_hf_checkpoint(work / "tiny", "qwen2_5_vl")
    try:
        return measure_process(convert_command(hf_path, work / "tiny-out"))
    finally:
        shutil.rmtree(work / "tiny", ignore_errors=True)
        shutil.rmtree(work / "tiny-out", ignore_errors=True)


def convert_at_depth(work: pathlib.Path, sweep: Sweep, text_layers: int, constant: dict) -> dict:
    """Write a synthetic checkpoint with `text_layers` layers, convert it in a fresh process, delete both."""
    hf_path, out_dir = work / f"hf-{text_layers}", work / f"megatron-{text_layers}"
    config = synthetic_config(text_layers, text=sweep.text, vision=sweep.vision, vision_depth=sweep.vision_depth)
    try:
        started = time.perf_counter()
        sizes = write_random_hf_checkpoint(hf_path, config, max_shard_bytes=sweep.shard_bytes)
        write_seconds = time.perf_counter() - started
        measured = measure_process(convert_command(hf_path, out_dir))
        out_bytes = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(hf_path, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    growth = measured["peak_rss_bytes"] - constant["peak_rss_bytes"]
    anon_growth = measured["peak_anon_rss_bytes"] - constant["peak_anon_rss_bytes"]
    return {
        "text_layers": text_layers,
        **sizes,
        "megatron_checkpoint_bytes": out_bytes,
        "write_seconds": round(write_seconds, 2),
        **measured,
        "growth_bytes": growth,
        "growth_over_largest_shard": round(growth / sizes["largest_shard_bytes"], 3),
        "growth_over_checkpoint": round(growth / sizes["weight_bytes"], 3),
        "anon_growth_over_checkpoint": round(anon_growth / sizes["weight_bytes"], 3),
    }


def depth_scaling(rows: list[dict]) -> dict | None:
    """Peak RSS added per extra decoder layer, against the bytes of one layer (1.0 = one copy of each layer)."""
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    layers = last["text_layers"] - first["text_layers"]
    layer_bytes = (last["weight_bytes"] - first["weight_bytes"]) / layers
    per_layer = (last["peak_rss_bytes"] - first["peak_rss_bytes"]) / layers
    return {
        "layer_bytes": round(layer_bytes),
        "peak_rss_per_layer_bytes": round(per_layer),
        "peak_rss_per_layer_over_layer_bytes": round(per_layer / layer_bytes, 3),
    }


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Run the conversion benchmark; write `bench_convert.json` into out_dir and return the results."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="qvl-bench-convert-") as tmp:
        work = pathlib.Path(tmp)
        constant = baseline(work)
        rows = [convert_at_depth(work, sweep, depth, constant) for depth in sweep.depths]
    results = {
        "quick": quick,
        "shape": sweep.name,
        "command": f"qvl convert import HF_DIR OUT_DIR --dtype {CONVERT_DTYPE} --device cpu (TP=PP=1), one process each",
        "constant": constant | {"what": "the same command on the tiny Qwen2.5-VL checkpoint (< 2 MB of weights)"},
        "depths": rows,
        "depth_scaling": depth_scaling(rows),
        "goals": {"growth_over_largest_shard": GOAL_GROWTH_OVER_LARGEST_SHARD},
    }
    results.update(assess(rows, results["depth_scaling"]))
    (out_dir / "bench_convert.json").write_text(json.dumps(results, indent=2))
    return results


def assess(rows: list[dict], scaling: dict | None) -> dict:
    """Whether the goal is met, why not, and per-depth checks for the summary table."""
    goal = GOAL_GROWTH_OVER_LARGEST_SHARD
    checks = []
    for r in rows:
        checks.append(
            {
                "figure": f"{r['text_layers']} layers, {r['weight_bytes'] / 2**30:.2f} GiB in {r['shards']} shards: "
                "(peak RSS - constant) / largest shard",
                "value": r["growth_over_largest_shard"],
                "goal": f"<= {goal}",
                "met": r["growth_over_largest_shard"] <= goal,
            }
        )
        checks.append(
            {
                "figure": f"{r['text_layers']} layers: peak RSS GiB | wall s | growth / checkpoint",
                "value": f"{r['peak_rss_bytes'] / 2**30:.2f} | {r['seconds']:.0f} | {r['growth_over_checkpoint']}",
                "goal": "",
                "met": None,
            }
        )
    if scaling:
        checks.append(
            {
                "figure": "peak RSS added per extra layer / bytes of one layer",
                "value": scaling["peak_rss_per_layer_over_layer_bytes"],
                "goal": "flat (~0)",
                "met": None,
            }
        )
    met = all(c["met"] for c in checks if c["met"] is not None)
    why = (
        None
        if met
        else (
            "peak RSS grew beyond 1.5 x the largest shard: something in the import holds more than one tensor at a time "
            "(see growth_over_checkpoint and depth_scaling; qvl.bridges.stream should hold one parameter)"
        )
    )
    return {"goal_met": met, "why": why, "checks": checks}


def import_growth_in_this_process(jobs: list[tuple[str, str]]) -> list[dict]:
    """Import each (hf_path, out_dir) in turn here; per import, peak RSS over the RSS just before it (Linux).

    Freed heap is handed back (malloc_trim) and the kernel's high-water mark reset (/proc/self/clear_refs)
    before each import, so each peak is its own. Run the tiny checkpoint first: its import pays the
    one-off lazy imports and set-up, which the later ones then do not count.
    """
    import ctypes
    import gc

    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    libc = ctypes.CDLL("libc.so.6")
    rows = []
    for hf_path, out_dir in jobs:
        gc.collect()
        libc.malloc_trim(0)
        before = _proc_status()["VmRSS"]
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM, ru_maxrss)
        started = time.perf_counter()
        run_on_ranks(convert.import_on_rank, hf_path, out_dir, CONVERT_DTYPE, cpu=True)
        peak = _proc_status()["VmHWM"]
        rows.append(
            {
                "hf_path": hf_path,
                "rss_before_bytes": before,
                "peak_rss_bytes": peak,
                "growth_bytes": peak - before,
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    return rows


def _proc_status() -> dict[str, int]:
    fields = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--import-growth",
        nargs="+",
        metavar="DIR",
        help="HF_DIR OUT_DIR pairs: import each in this process, print per-import RSS growth as JSON",
    )
    cli_args = parser.parse_args()
    if cli_args.import_growth:
        pairs = list(zip(cli_args.import_growth[::2], cli_args.import_growth[1::2], strict=True))
        print(json.dumps(import_growth_in_this_process(pairs)))
    else:
        print(json.dumps(run(cli_args.out, quick=cli_args.quick), indent=2))
