"""Data pipeline benchmark: packing efficiency vs baselines, packer speed, shard-writing throughput.

The length mix is synthetic but shaped like LLaVA-665k under Qwen2.5-VL's default processor settings:
~8% text-only conversations, ~87% one image at one of several common resolutions, ~5% two to four images;
text lengths are log-normal with a long tail of multi-turn samples. Image token counts come from the real
resize rule (`vision_tokens_for_image`), so they are what `qvl data prepare` would count for those sizes.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import tarfile
import tempfile
import time

import numpy as np

from qvl.data.count import TokenizedSample
from qvl.data.pack import pack_best_fit_decreasing, pack_next_fit, pack_padded
from qvl.data.validate import MediaInfo
from qvl.data.vision import VisionConfig, vision_tokens_for_image
from qvl.data.write import WriteConfig, pack_members, write_shards

SEQ_LENGTHS = (4096, 8192, 16384)
# Qwen2.5-VL defaults (preprocessor_config.json of the released checkpoints).
QWEN25_VISION = VisionConfig(
    family="qwen2_5_vl",
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    video_patch_size=14,
    video_min_pixels=128 * 28 * 28,
    video_max_pixels=28 * 28 * 768,
    video_fps=2.0,
    video_min_frames=4,
    video_max_frames=768,
    video_do_sample_frames=False,
)
# (height, width) of typical LLaVA-665k sources: COCO, GQA, OCR-VQA, TextVQA, VG.
RESOLUTIONS = ((480, 640), (375, 500), (427, 640), (640, 480), (336, 336), (768, 1024), (600, 800), (1024, 683))


def llava_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Token lengths of n synthetic samples with LLaVA-665k's mix of text-only, one-image and multi-image."""
    rng = np.random.default_rng(seed)
    image_tokens = np.asarray([vision_tokens_for_image(h, w, QWEN25_VISION) + 2 for h, w in RESOLUTIONS])
    kind = rng.choice(3, size=n, p=[0.08, 0.87, 0.05])  # text-only, one image, multi-image
    text = np.clip(rng.lognormal(mean=5.0, sigma=0.9, size=n), 20, 3500).astype(np.int64) + 20  # + template
    images = np.where(kind == 0, 0, np.where(kind == 1, 1, rng.integers(2, 5, size=n)))
    vision = np.zeros(n, dtype=np.int64)
    for k in range(1, 5):
        mask = images >= k
        vision[mask] += image_tokens[rng.integers(0, len(image_tokens), size=int(mask.sum()))]
    return text + vision


def packing_efficiency(lengths: np.ndarray) -> list[dict]:
    """Efficiency of qvl's offline packer, naive padding and online next-fit at each seq length."""
    rows = []
    for seq_length in SEQ_LENGTHS:
        fitting = lengths[lengths <= seq_length]
        start = time.perf_counter()
        plan = pack_best_fit_decreasing(fitting, seq_length)
        elapsed = time.perf_counter() - start
        rows.append(
            {
                "seq_length": seq_length,
                "samples": int(len(fitting)),
                "dropped_too_long": int(len(lengths) - len(fitting)),
                "qvl_best_fit_decreasing": round(plan.efficiency(fitting), 5),
                "naive_padding": round(pack_padded(fitting, seq_length).efficiency(fitting), 5),
                "online_next_fit": round(pack_next_fit(fitting, seq_length).efficiency(fitting), 5),
                "qvl_packs": plan.n_packs,
                "qvl_seconds": round(elapsed, 4),
            }
        )
    return rows


def packer_speed(n: int, seq_length: int = 8192, repeats: int = 3) -> dict:
    """Samples per second of pack_best_fit_decreasing on n samples (best of `repeats`, one core)."""
    lengths = llava_like_lengths(n, seed=1)
    lengths = lengths[lengths <= seq_length]
    best = min(_timed(lambda: pack_best_fit_decreasing(lengths, seq_length)) for _ in range(repeats))
    return {
        "samples": int(len(lengths)),
        "seq_length": seq_length,
        "seconds": round(best, 4),
        "samples_per_second": round(len(lengths) / best),
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _synthetic_samples(root: pathlib.Path, n_samples: int, n_images: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(2)
    images = []
    for k in range(n_images):  # incompressible bytes of a typical JPEG's size
        path = root / f"img{k}.jpg"
        path.write_bytes(rng.integers(0, 256, int(rng.integers(40_000, 120_000)), dtype=np.uint8).tobytes())
        images.append(path)
    samples = []
    for index in range(n_samples):
        ids = rng.integers(10, 500, int(rng.integers(50, 400))).astype(np.int32)
        ids[5] = 5  # one image pad, expanded to its run
        samples.append(
            TokenizedSample(
                index=index,
                ids=ids,
                loss=np.ones(len(ids), np.uint8),
                runs=np.asarray([391], np.int32),
                image_grids=[(1, 34, 46)],
                media_first_token=[4],
                media=[MediaInfo(kind="image", path=images[index % n_images], height=480, width=640)],
            )
        )
    return samples


def shard_throughput(n_samples: int, out_dir: pathlib.Path) -> dict:
    """qvl's shard writer vs a plain tar of the same members (bytes/s), on local disk."""
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        root = pathlib.Path(tmp)
        samples = _synthetic_samples(root, n_samples, n_images=64)
        lengths = np.asarray([s.length for s in samples])
        plan = pack_best_fit_decreasing(lengths, 8192)
        config = WriteConfig(output=root / "ds", family="qwen2_5_vl", pad_ids=(5, 6), packs_per_shard=64)
        (root / "qvl").mkdir()
        qvl_seconds = _timed(lambda: write_shards(root / "qvl", plan, samples, config))
        qvl_bytes = sum(p.stat().st_size for p in (root / "qvl").glob("*.tar"))
        sources = _plain_sources(plan, samples, config)
        plain_seconds = _timed(lambda: _plain_tar(root / "plain.tar", sources))
    return {
        "samples": n_samples,
        "packs": plan.n_packs,
        "bytes": qvl_bytes,
        "qvl_MB_per_s": round(qvl_bytes / qvl_seconds / 1e6, 1),
        "plain_tar_MB_per_s": round(qvl_bytes / plain_seconds / 1e6, 1),
        "relative_to_plain_tar": round(plain_seconds / qvl_seconds, 3),
    }


def _plain_sources(plan, samples, config) -> list[tuple[str, bytes | pathlib.Path]]:
    """The same members as qvl writes: token/metadata bytes ready-made, images read from the same files."""
    sources = []
    for k in range(plan.n_packs):
        subs = [samples[i] for i in plan.pack(k)]
        members = list(pack_members(k, subs, config))
        paths = [info.path for sub in subs for info in sub.media]
        sources += members[:3] + [(name, path) for (name, _), path in zip(members[3:], paths, strict=True)]
    return sources


def _plain_tar(path: pathlib.Path, members: list[tuple[str, bytes | pathlib.Path]]) -> None:
    with open(path, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name, source in members:
            payload = source.read_bytes() if isinstance(source, pathlib.Path) else source
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        tar.close()
        raw.flush()
        os.fsync(raw.fileno())  # the qvl writer makes each shard durable before renaming it


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Run the data benchmarks; write `bench_data.json` into out_dir and return the results."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_mix, n_speed, n_write = (60_000, 200_000, 300) if quick else (665_000, 1_000_000, 2_000)
    results = {
        "quick": quick,
        "length_mix": {"samples": n_mix, "shape": "LLaVA-665k-like (8% text, 87% one image, 5% 2-4 images)"},
        "packing_efficiency": packing_efficiency(llava_like_lengths(n_mix)),
        "packer_speed": packer_speed(n_speed),
        "shard_writing": shard_throughput(n_write, out_dir),
        "goals": {"efficiency_at_8k": 0.995, "packer_samples_per_second": 1_000_000, "shard_writing_relative": 0.5},
    }
    (out_dir / "bench_data.json").write_text(json.dumps(results, indent=2))
    return results


def _print_table(results: dict) -> None:
    print(f"{'seq':>6} {'qvl BFD':>9} {'next-fit':>9} {'padding':>9} {'packs':>8}")
    for row in results["packing_efficiency"]:
        print(
            f"{row['seq_length']:>6} {row['qvl_best_fit_decreasing']:>9.4%} {row['online_next_fit']:>9.4%} "
            f"{row['naive_padding']:>9.4%} {row['qvl_packs']:>8}"
        )
    speed, shards = results["packer_speed"], results["shard_writing"]
    print(f"packer: {speed['samples_per_second']:,} samples/s on {speed['samples']:,} samples")
    print(
        f"shards: {shards['qvl_MB_per_s']} MB/s vs plain tar {shards['plain_tar_MB_per_s']} MB/s "
        f"({shards['relative_to_plain_tar']}x)"
    )


if __name__ == "__main__":
    from benchmarks.run import standalone

    standalone(__doc__, run, _print_table)
