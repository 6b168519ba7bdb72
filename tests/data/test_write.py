"""Writing is atomic (an interrupted run leaves nothing loadable), resumable and byte-for-byte deterministic."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from qvl.data import write
from qvl.data.prepare import PrepareConfig, prepare


def _config(synthetic_dataset, hf_dirs, output: pathlib.Path) -> PrepareConfig:
    input_path, media_root, _, _ = synthetic_dataset
    return PrepareConfig(
        input=input_path,
        media_root=media_root,
        family="qwen3_vl",
        tokenizer=hf_dirs["qwen3_vl"],
        seq_length=256,
        output=output,
        packs_per_shard=2,
    )


def _digests(directory: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("shard-*.tar"))}


def test_interrupted_write_leaves_no_dataset_and_rerun_resumes_identically(
    synthetic_dataset, hf_dirs, tmp_path, monkeypatch
):
    reference = tmp_path / "reference"
    prepare(_config(synthetic_dataset, hf_dirs, reference))
    assert len(_digests(reference)) >= 3

    output = tmp_path / "ds"
    real_write_shard = write._write_shard
    calls = []

    def crash_on_third_shard(path, *args, **kwargs):
        calls.append(path.name)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")
        return real_write_shard(path, *args, **kwargs)

    monkeypatch.setattr(write, "_write_shard", crash_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(_config(synthetic_dataset, hf_dirs, output))
    assert not output.exists()  # nothing Energon could load
    partial = write.partial_dir(output)
    assert len(_digests(partial)) == 2 and not (partial / ".nv-meta").exists()

    calls.clear()
    monkeypatch.setattr(
        write, "_write_shard", lambda path, *a, **k: calls.append(path.name) or real_write_shard(path, *a, **k)
    )
    prepare(_config(synthetic_dataset, hf_dirs, output))
    assert "shard-000000.tar" not in calls and "shard-000001.tar" not in calls  # finished shards were kept
    assert _digests(output) == _digests(reference)  # deterministic: resumed == fresh
    assert (output / ".nv-meta" / "dataset.yaml").is_file() and not partial.exists()


def test_changed_settings_discard_stale_partial_work(synthetic_dataset, hf_dirs, tmp_path):
    output = tmp_path / "ds"
    stale = write.start_partial(output, "another-fingerprint")
    (stale / "shard-000000.tar").write_bytes(b"stale")
    prepare(_config(synthetic_dataset, hf_dirs, output))
    assert (output / "shard-000000.tar").read_bytes() != b"stale"
