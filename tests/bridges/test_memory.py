"""Conversion memory: `qvl convert import` streams, so its memory follows the largest shard, not the model.

Growth is an import's peak RSS over the RSS of its process just before it; the imports run one after
another in one subprocess, after a tiny warm-up import that pays the one-off lazy imports and set-up,
with freed heap returned and the kernel's high-water mark reset between them. Bounds (the streamed import's memory goal):

    growth            <= 1.5 x the largest shard + 16 MiB   (the read buffer: qvl.bridges.stream)
    growth per layer  <= 0.25 x the bytes of one layer      (flat as depth grows)

A materialised import (Megatron-Bridge's: the whole model built, loaded, then saved) grows by the model
(1.4x and 1.2x the checkpoint at 2 and 8 layers, 1.0x per added layer) and fails both.

glibc's mmap threshold is pinned at 1 MiB in the subprocess: released checkpoints' tensors are far above
its dynamic ceiling (32 MiB) and go back to the OS when freed, while this test's ~8 MiB tensors would
otherwise linger in a fragmented heap and add noise.

Measured on 2 CPU cores (bf16 -> bf16, half-width Qwen2.5-VL, 32 MiB shard limit; the 64 MiB embedding is
the largest shard): 2 layers (155 MiB, 4 shards) 81 MiB = 1.27x the largest shard; 8 layers (329 MiB,
10 shards) 82 MiB = 1.27x; per added layer 0.002x its bytes. Before streaming: 220 and 395 MiB.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks.bench_convert import MID_TEXT, MID_VISION, synthetic_config, write_random_hf_checkpoint
from qvl.bridges.tiny_model import write_tiny_hf_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPTHS = (2, 8)
SHARD_BYTES = 32 * 2**20
STREAMING_GOAL = 1.5  # the goal: growth <= 1.5 x the largest shard + a constant
CONSTANT = 16 * 2**20  # qvl.bridges.stream._READ_BUFFER_BYTES
PER_LAYER_BOUND = 0.25

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not pathlib.Path("/proc/self/clear_refs").exists(),
        reason="needs Linux /proc/self/clear_refs to reset the peak RSS between imports",
    ),
]


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[int, dict]:
    """Per depth: checkpoint sizes and the import's RSS growth, all measured in one subprocess."""
    root = tmp_path_factory.mktemp("memory")
    jobs = [(write_tiny_hf_checkpoint(root / "tiny", "qwen2_5_vl"), root / "tiny-out")]
    sizes = {}
    for depth in DEPTHS:
        config = synthetic_config(depth, text=MID_TEXT, vision=MID_VISION)
        sizes[depth] = write_random_hf_checkpoint(root / f"hf-{depth}", config, max_shard_bytes=SHARD_BYTES)
        jobs.append((root / f"hf-{depth}", root / f"out-{depth}"))
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_convert",
        "--import-growth",
        *(str(p) for job in jobs for p in job),
    ]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # see the module docstring
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    _, *measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {depth: sizes[depth] | row for depth, row in zip(DEPTHS, measured, strict=True)}


def _describe(row: dict) -> str:
    return (
        f"{row['weight_bytes'] / 2**20:.0f} MiB in {row['shards']} shards, largest {row['largest_shard_bytes'] / 2**20:.0f} MiB: "
        f"growth {row['growth_bytes'] / 2**20:.0f} MiB = {row['growth_bytes'] / row['largest_shard_bytes']:.2f} x largest shard"
    )


def test_checkpoints_are_multi_shard(imports):
    assert all(row["shards"] >= 4 for row in imports.values()), {d: r["shards"] for d, r in imports.items()}


@pytest.mark.parametrize("depth", DEPTHS)
def test_import_memory_follows_the_largest_shard(imports, depth):
    row = imports[depth]
    assert row["growth_bytes"] <= STREAMING_GOAL * row["largest_shard_bytes"] + CONSTANT, _describe(row)


def test_memory_is_flat_as_depth_grows(imports):
    shallow, deep = imports[DEPTHS[0]], imports[DEPTHS[-1]]
    layer_bytes = (deep["weight_bytes"] - shallow["weight_bytes"]) / (DEPTHS[-1] - DEPTHS[0])
    per_layer = (deep["growth_bytes"] - shallow["growth_bytes"]) / (DEPTHS[-1] - DEPTHS[0])
    assert per_layer <= PER_LAYER_BOUND * layer_bytes, (
        f"each added layer costs {per_layer / layer_bytes:.2f} x its bytes; {_describe(shallow)}; {_describe(deep)}"
    )
