"""One process, N worker processes and a local Ray cluster build byte-identical datasets from the same input."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from qvl.data.parallel import RayConfig
from qvl.data.prepare import PrepareConfig, prepare

CHUNK_SIZE = 5  # the synthetic set (~36 records) spans several chunks (more than 2), good and bad ones mixed


def _config(synthetic_dataset, hf_paths, output: pathlib.Path, **spread) -> PrepareConfig:
    input_path, media_root, _, _ = synthetic_dataset
    return PrepareConfig(
        input=input_path,
        media_root=media_root,
        family="qwen2_5_vl",
        hf_path=hf_paths["qwen2_5_vl"],
        seq_length=512,
        output=output,
        packs_per_shard=2,
        chunk_size=CHUNK_SIZE,
        **spread,
    )


def _files(directory: pathlib.Path) -> dict[str, str]:
    paths = sorted(directory.glob("shard-*.tar")) + [directory / "packs.jsonl", directory / "quarantine.jsonl"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def one_process(synthetic_dataset, hf_paths, tmp_path_factory):
    output = tmp_path_factory.mktemp("one") / "ds"
    report = prepare(_config(synthetic_dataset, hf_paths, output, workers=1))
    assert report["workers"] == "1 process" and report["packed_sequences"] >= 3
    return _files(output), report


def _same_counts(report: dict, reference: dict) -> None:
    for key in ("read", "accepted", "quarantined_by_reason", "total_tokens", "packed_sequences", "shards"):
        assert report[key] == reference[key], key


def test_two_workers_build_the_same_bytes(synthetic_dataset, hf_paths, one_process, tmp_path):
    output = tmp_path / "ds"
    report = prepare(_config(synthetic_dataset, hf_paths, output, workers=2))
    assert report["workers"] == "2 worker processes"
    _same_counts(report, one_process[1])
    assert _files(output) == one_process[0]


@pytest.mark.slow
def test_a_local_ray_cluster_builds_the_same_bytes(synthetic_dataset, hf_paths, one_process, tmp_path_factory):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    output = tmp_path_factory.mktemp("ray") / "ds"
    settings = RayConfig(num_cpus=2, temp_dir=tmp_path_factory.mktemp("rt"))
    report = prepare(_config(synthetic_dataset, hf_paths, output, ray=settings))
    assert report["workers"] == "Ray (2 CPUs)"
    assert not ray.is_initialized()  # the cluster qvl started is shut down again
    _same_counts(report, one_process[1])
    assert _files(output) == one_process[0]
