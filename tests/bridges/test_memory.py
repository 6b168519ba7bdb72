"""Conversion memory (issue 3): `qvl convert import` holds one copy of the weights, never two.

Growth is an import's peak RSS over the RSS of its process just before it; the imports run one after
another in one subprocess, after a tiny warm-up import that pays the one-off lazy imports and set-up,
with freed heap returned and the kernel's high-water mark reset between them. Bounds:

    growth            <= 1.5 x checkpoint bytes + 64 MiB
    growth per layer  <= 1.5 x the bytes of one layer     (the ratio does not rise with depth)

One bf16 Megatron copy of the weights is 1.0x; transients of initialisation and loading (fp32 init of a
tensor, mapped safetensors pages) add a roughly fixed amount. A second full copy held at the same time
(an HF model next to the Megatron one, a second state dict) adds >= 1.0x and fails both bounds: holding
a copy of the HF tensors through the import measured 375 MiB (2 layers, bound 297), 724 MiB (8 layers,
bound 558) and 2.0x per layer.

glibc's mmap threshold is pinned at 1 MiB in the subprocess: released checkpoints' tensors are far above
its dynamic ceiling (32 MiB) and go back to the OS when freed, while this test's ~8 MiB tensors would
otherwise linger in a fragmented heap and add 0.3-0.6x of noise.

Measured on 2 CPU cores (bf16 -> bf16, half-width Qwen2.5-VL, 32 MiB shards), two runs: 2 layers (155 MiB,
4 shards) 220 MiB = 1.42x; 8 layers (329 MiB, 10 shards) 395 MiB = 1.20x; per added layer 1.00x. The
conversion benchmark (Qwen2.5-VL-3B widths, 1.4-2.5 GiB) shows the same: 1.08x per added layer.

Megatron-Bridge's import builds the whole Megatron model before saving it, so memory follows the
checkpoint, not its largest shard: the issue's goal (growth <= 1.5 x largest shard at any depth) is not
met today. `test_streaming_goal` states it as a strict xfail, so it fails (XPASS) the day imports stream,
and the bounds above can then be tightened.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks.bench_convert import MID_TEXT, MID_VISION, synthetic_config, write_random_hf_checkpoint
from qvl.bridges.testing import write_tiny_hf_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPTHS = (2, 8)
SHARD_BYTES = 32 * 2**20
PER_BYTE_BOUND = 1.5
CONSTANT_BOUND = 64 * 2**20
STREAMING_GOAL = 1.5  # issue 3: growth <= 1.5 x the largest shard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(),
                       reason="needs Linux /proc/self/clear_refs to reset the peak RSS between imports"),  # fmt: skip
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
    command = [sys.executable, "-m", "benchmarks.bench_convert", "--import-growth", *(str(p) for job in jobs for p in job)]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # see the module docstring
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    _, *measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {depth: sizes[depth] | row for depth, row in zip(DEPTHS, measured, strict=True)}


def _describe(row: dict) -> str:
    return (f"{row['weight_bytes'] / 2**20:.0f} MiB in {row['shards']} shards: growth {row['growth_bytes'] / 2**20:.0f} MiB "
            f"= {row['growth_bytes'] / row['weight_bytes']:.2f} x checkpoint")  # fmt: skip


def test_checkpoints_are_multi_shard(imports):
    assert all(row["shards"] >= 4 for row in imports.values()), {d: r["shards"] for d, r in imports.items()}


@pytest.mark.parametrize("depth", DEPTHS)
def test_import_holds_one_copy_of_the_weights(imports, depth):
    row = imports[depth]
    assert row["growth_bytes"] <= PER_BYTE_BOUND * row["weight_bytes"] + CONSTANT_BOUND, _describe(row)
    # Today's path materialises the model: far less growth means the measurement broke (or imports now
    # stream; then tighten the bounds above and drop the xfail below).
    assert row["growth_bytes"] >= 0.5 * row["weight_bytes"], _describe(row)


def test_growth_per_layer_is_one_copy_of_the_layer(imports):
    shallow, deep = imports[DEPTHS[0]], imports[DEPTHS[-1]]
    layer_bytes = (deep["weight_bytes"] - shallow["weight_bytes"]) / (DEPTHS[-1] - DEPTHS[0])
    per_layer = (deep["growth_bytes"] - shallow["growth_bytes"]) / (DEPTHS[-1] - DEPTHS[0])
    assert per_layer <= PER_BYTE_BOUND * layer_bytes, (
        f"each added layer costs {per_layer / layer_bytes:.2f} x its bytes; {_describe(shallow)}; {_describe(deep)}")


@pytest.mark.xfail(strict=True, reason="Megatron-Bridge's import builds the whole Megatron model before saving it")
def test_streaming_goal(imports):
    for row in imports.values():
        assert row["growth_bytes"] <= STREAMING_GOAL * row["largest_shard_bytes"], _describe(row)
