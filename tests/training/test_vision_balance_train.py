"""`vision_balance=true` in the real training loop (`qvl train` on two gloo ranks, tiny Qwen2.5-VL, fp32): at DP=2 on a
dataset whose plan gives one rank every image, and at TP=2 (one replica, both ranks hold every image), the
balanced run encodes each image once, evens out the vision FLOPs and reproduces the replicated run's losses;
at PP=2 it trains like PP=1."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from qvl.training.loop import read_losses
from tests.run_qvl import qvl_in_process, qvl_on_rank, qvl_on_two_ranks
from tests.training.test_train import ARGS

pytestmark = pytest.mark.slow  # training runs on two gloo ranks forked from one server (start_ranks)

IMAGES_PER_SAMPLE = 3
# Per step, (rank 0's packs, rank 1's packs) in micro-batch order: step 1 gives rank 0 both image packs,
# step 2 one image pack per rank but in opposite micro-batches, step 3 no images at all.
SKEW = (
    (("image", "image"), ("text", "text")),
    (("image", "text"), ("text", "image")),
    (("text", "text"), ("text", "text")),
)


@pytest.fixture(scope="module")
def skewed_dataset(tiny_qwen25_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """8 samples of three distinct images (two samples per pack) and 8 text-only samples (one per pack),
    planned by SKEW, for the session's tiny Qwen2.5-VL. Distinct images, so an embedding returned to the wrong
    place would change the loss."""
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
    hf = tiny_qwen25_checkpoint
    qvl_in_process(
        "data",
        "prepare",
        "--input",
        str(root / "samples.jsonl"),
        "--media-root",
        str(root / "media"),
        "--family",
        "qwen2_5_vl",
        "--hf-path",
        str(hf),
        "--seq-length",
        "256",
        "--output",
        str(root / "data"),
        "--data-parallel",
        "2",
        "--global-batch-size",
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


def one_replica_plan(data: Path, out: Path) -> Path:
    """A copy of the DP=2-planned dataset re-planned for one replica (TP=2 or PP=2 on two ranks): rank r's slot s
    becomes slot 2r + s, so each step's micro-batches and their images are the same ones, on one replica."""
    shutil.copytree(data, out)
    packs = [json.loads(line) for line in (out / "packs.jsonl").read_text().splitlines()]
    for pack in packs:
        if pack.get("step", -1) >= 0:
            pack.update(slot=2 * pack["rank"] + pack["slot"], rank=0)
    (out / "packs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in packs))
    report = json.loads((out / "report.json").read_text())
    report["dp_plan"].update(data_parallel=1, packs_per_rank_per_step=4)
    (out / "report.json").write_text(json.dumps(report))
    return out


def common_args(data: Path, hf: Path) -> list[str]:
    # No warmup: step 1 already updates the weights, so every later loss depends on a balanced backward.
    # No TensorBoard writing: only the losses are compared. (`checkpoint.save=none` would save ~7% of each run's
    # CPU time more, but train.check_inputs at f1a38f5 refuses a None checkpoint.save: Path(None).)
    return [
        *ARGS,
        f"train_iters={len(SKEW)}",
        "global_batch_size=4",
        "warmup_iters=0",
        f"data={data}",
        f"hf_path={hf}",
        "tensorboard_dir=none",
        "--model",
        "tiny",
        "--device",
        "cpu",
    ]


def train_on_ranks(runs: dict[str, list[str]]) -> dict[str, str]:
    """On each of two gloo ranks: `qvl -v train ARGS` for every run in turn; returns each run's log on this rank."""
    return {name: qvl_on_rank(["-v", "train", *args]) for name, args in runs.items()}


@pytest.fixture(scope="module")
def two_rank_runs(skewed_dataset, one_replica_dataset, tmp_path_factory) -> dict[str, tuple[dict[int, float], str]]:
    """Replicated and balanced runs at DP=2 (the skewed plan) and TP=2 (one replica): losses, and both ranks' logs
    (debug included) as torchrun would have interleaved them."""
    from qvl.foundation.distributed import run_on_ranks

    root = tmp_path_factory.mktemp("runs")
    layouts = {"dp": common_args(*skewed_dataset), "tp": [*common_args(*one_replica_dataset), "tensor_parallel=2"]}
    args = {
        f"{layout}_{name}": [*common, f"vision_balance={flag}", "--run-dir", str(root / f"{layout}_{name}")]
        for layout, common in layouts.items()
        for name, flag in (("off", "false"), ("on", "true"))
    }
    ranks = run_on_ranks(train_on_ranks, args, world_size=2, cpu=True)
    return {name: (read_losses(root / name), "".join(rank[name] for rank in ranks)) for name in args}


@pytest.fixture(scope="module")
def runs(two_rank_runs) -> dict[str, tuple[dict[int, float], str]]:
    return {name: two_rank_runs[f"dp_{name}"] for name in ("off", "on")}


PLAN_LINE = re.compile(
    r"vision balance: (\d+) images moved of (\d+); vision FLOPs per rank \[([^\]]*)\] -> \[([^\]]*)\]; "
    r"images encoded per rank \[([^\]]*)\]"
)


def plan_lines(log: str) -> list[tuple[int, int, list[float], list[float], list[int]]]:
    """(moved, images, FLOPs per rank replicated, FLOPs per rank balanced, images per rank) per micro-batch."""
    return [
        (int(moved), int(total), *([float(x) for x in f.split(", ")] for f in (before, after)),
         [int(x) for x in encoded.split(", ")])
        for moved, total, before, after, encoded in PLAN_LINE.findall(log)
    ]  # fmt: skip


def images_encoded(log: str) -> int:
    """Images the ranks' tower calls were given, summed over ranks and micro-batches (each rank logs its own)."""
    return sum(int(n) for n in re.findall(r"vision balance rank \d+: encoding (\d+) images", log))


def test_balanced_run_moves_images_to_the_idle_rank(runs):
    balanced = plan_lines(runs["on"][1])
    assert "vision balance:" not in runs["off"][1]
    # One line per micro-batch with images: two in step 1, two in step 2 (step 3 has none); each time one rank
    # holds all 6 images and the other none, and after balancing the busier rank's vision FLOPs are within 1.15x
    # of the mean.
    assert len(balanced) == 4, balanced
    for moved, total, before, after, encoded in balanced:
        assert (total, min(before)) == (6, 0) and moved >= 1 and sum(encoded) == 6
        assert max(after) <= 1.15 * sum(after) / len(after), (before, after)
    assert images_encoded(runs["on"][1]) == 4 * 6  # each image once


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


@pytest.fixture(scope="module")
def one_replica_dataset(skewed_dataset, tmp_path_factory) -> tuple[Path, Path]:
    data, hf = skewed_dataset
    return one_replica_plan(data, tmp_path_factory.mktemp("one_replica") / "data"), hf


@pytest.fixture(scope="module")
def tp_runs(two_rank_runs) -> dict[str, tuple[dict[int, float], str]]:
    """TP=2 on one replica: the replicated tower (both TP ranks encode all 6 images) and the grid (each once)."""
    return {name: two_rank_runs[f"tp_{name}"] for name in ("off", "on")}


def test_tensor_parallel_ranks_split_the_images_and_encode_each_once(tp_runs):
    balanced = plan_lines(tp_runs["on"][1])
    # Step 1 has image packs in micro-batches 1 and 2, step 2 in 1 and 4: four micro-batches of 6 images, all in
    # the one replica. Replicated, both TP ranks encode all 6 (FLOPs before = the replica's whole cost on each).
    assert len(balanced) == 4, balanced
    for moved, total, before, after, encoded in balanced:
        assert total == 6 and moved == 0 and sum(encoded) == 6 and min(encoded) >= 1  # pixels never move
        assert sum(before) == pytest.approx(2 * sum(after), rel=0.01)  # the log prints 3 significant digits
        assert max(after) <= 1.15 * sum(after) / len(after), after
    assert images_encoded(tp_runs["on"][1]) == 4 * 6


def test_tensor_parallel_grid_reproduces_the_replicated_losses(tp_runs):
    off, on = tp_runs["off"][0], tp_runs["on"][0]
    assert sorted(off) == sorted(on) == list(range(1, len(SKEW) + 1))
    # Step 1: same weights, bit-identical embeddings on both TP ranks (each image's rows come from one tower call
    # that attends per image), so the same loss bit for bit. The tower's gradient is then the TP average of
    # 2 x each rank's partial sum instead of the average of two full sums: the same sum of the same per-image
    # terms in another order, so later steps may differ by rounding (5e-6 is ~10 float32 ulps of the loss). A
    # tower gradient averaged without the x2 (half the right one) moves step 2 far beyond that (see
    # tests/training/test_vision_grads.py for the gradients themselves).
    assert on[1] == off[1]
    for step in off:
        assert on[step] == pytest.approx(off[step], abs=5e-6)


def test_pipeline_parallel_2_with_vision_balance_trains_like_one_stage(
    one_replica_dataset, tiny_qwen25_megatron, tmp_path
):
    """PP=2: the tower and the balancer live on stage 0 (its grid is the one rank there: nothing moves, and the
    last stage must not join its collectives); the losses equal a one-process PP=1 run's, as in test_train.py:
    from one converted checkpoint (a pretrain recipe's random init differs between PP=1 and PP=2)."""
    data, hf = one_replica_dataset
    common = ["qwen2_5_vl_3b_sft", f"pretrained_checkpoint={tiny_qwen25_megatron}", *common_args(data, hf)[1:]]
    qvl_on_two_ranks("train", *common, "pipeline_parallel=2", "vision_balance=true", "--run-dir", str(tmp_path / "pp2"))
    qvl_in_process("train", *common, "vision_balance=true", "--run-dir", str(tmp_path / "pp1"))
    one, two = read_losses(tmp_path / "pp1"), read_losses(tmp_path / "pp2")
    assert sorted(two) == sorted(one) == list(range(1, len(SKEW) + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5)
