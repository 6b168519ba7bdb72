"""Writing is atomic (a run killed with SIGKILL leaves nothing loadable), resumable and byte-for-byte deterministic.

The kills are real: `qvl data prepare` runs in a subprocess and gets SIGKILL once its partial directory shows it
is inside the stage under test.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from qvl.data import write
from qvl.data.prepare import PrepareConfig, prepare

from .conftest import save_image, write_jsonl

SEQ_LENGTH = 160
CHUNK_SIZE = 4
N_SAMPLES = 160


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few hundred short samples (some with images, some bad): many chunks and, at one pack a shard, many shards."""
    root = tmp_path_factory.mktemp("kill")
    for k in range(4):
        save_image(root / f"{k}.png", 40 + 8 * k, 32, seed=k)
    records = []
    for i in range(N_SAMPLES):
        turns = [{"from": "human", "value": ("<image>\n" if i % 3 == 0 else "") + "Count " + "1 " * (i % 9)}]
        turns.append({"from": "gpt", "value": "Done " * (1 + i % 5)})
        record = {"conversations": turns}
        if i % 3 == 0:
            record["image"] = f"{i % 4}.png" if i % 50 else "missing.png"
        records.append(record)
    return write_jsonl(root / "in.jsonl", records), root


def _config(corpus, hf_paths, output: pathlib.Path) -> PrepareConfig:
    input_path, media_root = corpus
    return PrepareConfig(
        input=input_path,
        media_root=media_root,
        family="qwen2_vl",
        hf_path=hf_paths["qwen2_vl"],
        seq_length=SEQ_LENGTH,
        output=output,
        packs_per_shard=1,
        chunk_size=CHUNK_SIZE,
    )


def _argv(config: PrepareConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qvl.launchers.cli",
        "data",
        "prepare",
        "--input",
        str(config.input),
        "--media-root",
        str(config.media_root),
        "--family",
        config.family,
        "--hf-path",
        str(config.hf_path),
        "--seq-length",
        str(config.seq_length),
        "--output",
        str(config.output),
        "--packs-per-shard",
        str(config.packs_per_shard),
        "--chunk-size",
        str(config.chunk_size),
        "--workers",
        "1",
        "--quiet",
    ]


def _files(directory: pathlib.Path) -> dict[str, str]:
    """sha256 of the shards and the jsonl outputs."""
    paths = sorted(directory.glob("shard-*.tar")) + [directory / "packs.jsonl", directory / "quarantine.jsonl"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _kill_when(config: PrepareConfig, ready, timeout: float = 120.0) -> None:
    """Start prepare in a subprocess and SIGKILL it as soon as `ready(partial_dir)` holds."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    process = subprocess.Popen(_argv(config), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = write.partial_dir(config.output)
    deadline = time.monotonic() + timeout
    try:
        while not ready(partial):
            if process.poll() is not None:
                pytest.fail(f"prepare ended (rc {process.returncode}) before the kill point: {process.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail("prepare never reached the kill point")
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL


def _chunks_done(partial: pathlib.Path) -> int:
    return len(list((partial / "chunks").glob("*.npz")))


@pytest.fixture(scope="module")
def reference(corpus, hf_paths, tmp_path_factory):
    output = tmp_path_factory.mktemp("reference") / "ds"
    prepare(_config(corpus, hf_paths, output))
    files = _files(output)
    assert len(files) > 20  # many shards, so the write kill lands between two of them
    return files


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_killed_while_validating_leaves_no_dataset_and_rerun_reuses_chunks(corpus, hf_paths, reference, tmp_path):
    config = _config(corpus, hf_paths, tmp_path / "ds")
    _kill_when(config, lambda partial: _chunks_done(partial) >= 3)
    assert not config.output.exists()  # nothing Energon could load
    finished = _chunks_done(write.partial_dir(config.output))
    report = prepare(config)
    assert report["reused"]["chunks"] == finished >= 3
    assert _files(config.output) == reference  # resumed == fresh, byte for byte
    assert not write.partial_dir(config.output).exists() and not (config.output / "chunks").exists()


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_killed_while_writing_leaves_no_dataset_and_rerun_reuses_shards(corpus, hf_paths, reference, tmp_path):
    config = _config(corpus, hf_paths, tmp_path / "ds")
    _kill_when(config, lambda partial: len(list(partial.glob("shard-*.tar"))) >= 2)
    partial = write.partial_dir(config.output)
    assert not config.output.exists() and not (partial / ".nv-meta").exists()
    report = prepare(config)
    assert report["reused"]["shards"] >= 2 and report["reused"]["chunks"] == -(-N_SAMPLES // CHUNK_SIZE)
    assert _files(config.output) == reference
    assert (config.output / ".nv-meta" / "dataset.yaml").is_file() and not partial.exists()


def test_changed_settings_discard_stale_partial_work(corpus, hf_paths, tmp_path):
    output = tmp_path / "ds"
    stale = write.start_partial(output, "another-fingerprint")
    (stale / "shard-000000.tar").write_bytes(b"stale")
    prepare(_config(corpus, hf_paths, output))
    assert (output / "shard-000000.tar").read_bytes() != b"stale"


def test_default_shard_size_spreads_small_datasets_and_caps_large_ones():
    from qvl.data.write import auto_packs_per_shard, shard_packs

    assert auto_packs_per_shard(340) == 16 and len(shard_packs(340, 16)) == 22  # 2 shards of 256 + 84 before
    assert auto_packs_per_shard(8_000) == 125 and len(shard_packs(8_000, 125)) == 64
    assert auto_packs_per_shard(100_000) == 256 and auto_packs_per_shard(1) == 16
