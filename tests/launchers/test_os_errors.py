"""OS errors on the storage a command writes to: one `error:` line naming the path and the way on, never a bare
`[Errno 28] No space left on device`. The full disks are real: a small tmpfs (root only; skipped elsewhere)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from qvl.foundation.errors import ConfigError
from qvl.launchers.cli import main
from qvl.launchers.os_errors import describe_os_error, os_error_in, os_errors_as
from tests.launchers.test_bad_input import one_error_line
from tests.run_qvl import qvl_forked


@pytest.fixture
def small_disk(tmp_path):
    """`make(size)`: a tmpfs of that size under tmp_path; `grow(path, size)` remounts it larger; all unmounted."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    def grow(path: Path, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)

    make.grow = grow
    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def test_a_disk_that_fills_during_prepare_names_the_folder_and_the_same_command_resumes(
    small_disk, tiny_qwen25_checkpoint, tiny_dataset, capsys
):
    disk = small_disk("64k")  # the prepared set is ~190 KB
    samples = tiny_dataset.parent / "samples"
    argv = ["data", "prepare", "--input", str(samples / "conversations.jsonl"), "--media-root", str(samples / "images")]
    argv += ["--family", "qwen2_5_vl", "--hf-path", str(tiny_qwen25_checkpoint), "--seq-length", "256"]
    argv += ["--output", str(disk / "out"), "--workers", "1", "--quiet"]
    line = one_error_line(capsys, argv)
    assert line.startswith("error: no space left on the device at ") and "(ENOSPC)" in line, line
    assert str(disk / "out.partial") in line and f"df -h {disk}" in line, line
    assert line.endswith(f"then run the same command again: it resumes from {disk / 'out.partial'}/"), line
    small_disk.grow(disk, "8m")
    assert main(argv) == 0
    assert (disk / "out" / "shard-000000.tar").read_bytes() == (tiny_dataset / "shard-000000.tar").read_bytes()


def test_a_full_disk_during_conversion_names_the_output(small_disk, tiny_qwen25_checkpoint, capsys):
    disk = small_disk("256k")  # the tiny model's Megatron checkpoint is ~1.6 MB
    line = one_error_line(capsys, ["convert", "import", str(tiny_qwen25_checkpoint), str(disk / "mcore"), "--device",
                                    "cpu"])  # fmt: skip
    assert line.startswith("error: no space left on the device at ") and str(disk) in line, line
    assert line.endswith("then run the same command again: it writes the checkpoint anew"), line


def test_a_rank_failure_inside_a_distributed_checkpoint_is_found_and_worded():
    """torch.distributed.checkpoint wraps each rank's exception (a BaseException, not an OSError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = CheckpointException("save failed", {1: (full, None)})
    assert os_error_in(wrapped) is full
    with pytest.raises(ConfigError) as err, os_errors_as(ConfigError, where="/ckpt/run", then="then resume"):
        raise RuntimeError("save of iteration 4 failed") from wrapped
    assert str(err.value).startswith("no space left on the device at /ckpt/run (ENOSPC); free space there")
    with pytest.raises(SystemExit), os_errors_as(ConfigError, where="/x", then=""):  # a planned stop stays one
        raise SystemExit(0)


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EACCES, "permission denied at /data/out/a.bin (EACCES); make it writable for this user"),
        (errno.ESTALE, "the storage went away (stale file handle) at /data/out/a.bin (ESTALE); check that the"),
        (errno.EROFS, "read-only filesystem at /data/out/a.bin (EROFS); choose a folder on a writable"),
    ],
)
def test_each_os_error_says_what_where_and_the_way_on(code, words):
    line = describe_os_error(OSError(code, os.strerror(code), "/data/out/a.bin"), where="/data/out", then="then x")
    assert line.startswith(words) and line.endswith("; then x") and "\n" not in line


@pytest.mark.slow
def test_a_full_disk_while_training_saves_a_checkpoint_names_the_folder(
    small_disk, tiny_qwen25_checkpoint, tiny_dataset, tiny_qwen25_megatron, tmp_path
):
    """torch's distributed checkpoint hides the OS error (its zip writer raises `unexpected pos`); the line still
    says the checkpoint folder is full and that the same command resumes."""
    disk = small_disk("512k")  # the tiny model's checkpoint with its optimizer state is several MB
    argv = [
        "train",
        "qwen2_5_vl_3b_sft",
        "--model",
        "tiny",
        "--device",
        "cpu",
    ]
    argv += [
        f"data={tiny_dataset}",
        f"hf_path={tiny_qwen25_checkpoint}",
        f"pretrained_checkpoint={tiny_qwen25_megatron}",
    ]
    argv += ["train_iters=1", "warmup_iters=0", "global_batch_size=1", "micro_batch_size=1", "seq_length=256"]
    argv += ["save_interval=1", f"checkpoint_dir={disk / 'ckpt'}", "--run-dir", str(tmp_path / "run")]
    done = qvl_forked(*argv)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"error: no space left on the device at {disk / 'ckpt'} (ENOSPC)"), errors[0]
    assert errors[0].endswith(f"it resumes from the last checkpoint in {disk / 'ckpt'}"), errors[0]


def test_an_experiments_folder_on_a_read_only_filesystem_is_one_line_for_launch(small_disk, capsys):
    disk = small_disk("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    argv = ["launch", "demo", "steps=1", "--executor", "slurm", "run.executor.account=a", "run.executor.partition=p"]
    line = one_error_line(capsys, [*argv, "run.executor.gpus_per_node=0", "--experiments-dir", str(disk), "--dryrun"])
    assert line.startswith(f"error: read-only filesystem at {disk}") and "(EROFS)" in line, line
    assert line.endswith("then run the same command again (a job that was already submitted shows in `nemo "
                         "experiment list`)"), line  # fmt: skip
