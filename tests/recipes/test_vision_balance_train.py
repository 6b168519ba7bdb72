"""`vision_balance=true` in the real training loop: two data-parallel gloo ranks (torchrun) train the tiny
Qwen2.5-VL on a dataset whose plan gives one rank every image, and the balanced run moves images to the idle
rank yet reproduces the unbalanced run's losses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qvl.recipes.training.train import read_losses
from tests.recipes.test_train import ARGS, qvl

IMAGES_PER_SAMPLE = 3
# Per step, (rank 0's packs, rank 1's packs) in micro-batch order: step 1 gives rank 0 both image packs,
# step 2 one image pack per rank but in opposite micro-batches, step 3 no images at all.
SKEW = (
    (("image", "image"), ("text", "text")),
    (("image", "text"), ("text", "image")),
    (("text", "text"), ("text", "text")),
)


@pytest.fixture(scope="module")
def skewed_dataset(tmp_path_factory) -> tuple[Path, Path]:
    """8 samples of three distinct images (two samples per pack) and 8 text-only samples (one per pack),
    planned by SKEW. Distinct images, so an embedding returned to the wrong place would change the loss."""
    from qvl.bridges.tiny import write_tiny_hf_checkpoint
    from qvl.data.samples import COLOURS, SHAPES, draw_shape

    root = tmp_path_factory.mktemp("vision_balance")
    (root / "media").mkdir()
    rows = []
    for i in range(8):
        looks = [
            (SHAPES[(i + j) % 3], tuple(COLOURS)[(3 * i + j) % 4], (112, 112 - 28 * ((i + j) % 2)))
            for j in range(IMAGES_PER_SAMPLE)
        ]
        for j, (shape, colour, size) in enumerate(looks):
            draw_shape(shape, colour, size).save(root / "media" / f"{i}_{j}.png")
        answer = ", ".join(f"a {colour} {shape}" for shape, colour, _ in looks)
        rows.append(
            {
                "image": [f"{i}_{j}.png" for j in range(IMAGES_PER_SAMPLE)],
                "conversations": [
                    {"from": "human", "value": "<image>\n" * IMAGES_PER_SAMPLE + "What are these?"},
                    {"from": "gpt", "value": answer.capitalize() + "."},
                ],
            }
        )
    for i in range(8):  # long enough (~230 tokens) that no image sample fits beside one in a 256-token pack
        rows.append(
            {
                "conversations": [
                    {"from": "human", "value": f"{i}: " + "Count to twenty, slowly please. " * 6},
                    {"from": "gpt", "value": " ".join(map(str, range(1, 21))) * 2},
                ]
            }
        )
    (root / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen2_5_vl")
    qvl(
        "data",
        "prepare",
        "--input",
        str(root / "samples.jsonl"),
        "--media-root",
        str(root / "media"),
        "--family",
        "qwen2_5_vl",
        "--tokenizer",
        str(hf),
        "--seq-length",
        "256",
        "--output",
        str(root / "data"),
        "--data-parallel",
        "2",
        "--global-batch",
        "4",
    )
    skew_plan(root / "data", image_samples=range(8))
    return root / "data", hf


def skew_plan(data: Path, *, image_samples) -> None:
    """Rewrite packs.jsonl's (step, rank, slot) columns, which the planned loader follows, into SKEW's order."""
    packs = [json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines()]
    kinds = {
        "image": [p for p in packs if set(p["samples"]) <= set(image_samples)],
        "text": [p for p in packs if not set(p["samples"]) & set(image_samples)],
    }
    assert (len(kinds["image"]), len(kinds["text"])) == (4, 8), "each pack must be all-image or all-text"
    for step, ranks in enumerate(SKEW):
        for rank, slots in enumerate(ranks):
            for slot, kind in enumerate(slots):
                kinds[kind].pop().update(step=step, rank=rank, slot=slot)
    (data / "packs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in packs))


def torchrun_train(*args: str) -> str:
    """`qvl -v train ARGS` on two gloo processes; returns the output (debug logs included)."""
    from qvl.foundation.distributed import free_port

    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "qvl.launchers.cli",
        "-v",
        "train",
    ]
    out = subprocess.run([*torchrun, *args], capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def runs(skewed_dataset, tmp_path_factory) -> dict[str, tuple[dict[int, float], str]]:
    data, hf = skewed_dataset
    root = tmp_path_factory.mktemp("runs")
    # No warmup: step 1 already updates the weights, so every later loss depends on a balanced backward.
    # No checkpoint or TensorBoard writing: only the losses are compared (saves ~7% of each run's CPU time).
    common = [
        *ARGS,
        f"train_iters={len(SKEW)}",
        "global_batch_size=4",
        "warmup_iters=0",
        f"data={data}",
        f"hf_path={hf}",
        "tensorboard_dir=none",
        "checkpoint.save=none",
        "--model",
        "tiny",
        "--device",
        "cpu",
    ]
    out = {}
    for name, flag in (("off", "false"), ("on", "true")):
        log = torchrun_train(*common, f"vision_balance={flag}", "--run-dir", str(root / name))
        out[name] = read_losses(root / name), log
    return out


def test_balanced_run_moves_images_to_the_idle_rank(runs):
    balanced = re.findall(
        r"vision balance: (\d+) images moved of (\d+); vision FLOPs per rank \[(.*)\] -> \[(.*)\]", runs["on"][1]
    )
    assert "vision balance:" not in runs["off"][1]
    # One line per micro-batch with images: two in step 1, two in step 2 (step 3 has none); each time one rank
    # holds all 6 images and the other none, and after balancing the busier rank does at most 60% of the work.
    assert len(balanced) == 4, balanced
    for moved, total, before, after in balanced:
        before, after = ([float(x) for x in flops.split(", ")] for flops in (before, after))
        assert (int(total), min(before)) == (6, 0) and int(moved) >= 1
        assert max(after) <= 0.6 * sum(before), (before, after)


def test_balanced_run_reproduces_the_unbalanced_losses(runs):
    off, on = runs["off"][0], runs["on"][0]
    assert sorted(off) == sorted(on) == list(range(1, len(SKEW) + 1))
    # Step 1's forward sees identical weights and bit-identical image embeddings (fp32, CPU): the same loss bit
    # for bit. Afterwards the vision tower's gradients have been summed in another order (each image's gradient
    # on the rank that encoded it, then the data-parallel all-reduce), so the weights may differ by rounding;
    # 5e-6 is ~10 float32 ulps of the loss (measured: bit-identical here). Embeddings scattered into the wrong
    # placeholders (reversed) move step 1 by 1.7e-5 and later steps by 5e-5 to 8e-5, so both checks catch it.
    assert on[1] == off[1]
    for step in off:
        assert on[step] == pytest.approx(off[step], abs=5e-6)
