"""Energon's own tools read a `qvl data prepare` dataset: `energon info`, `energon lint` (as subprocesses) and
`get_train_dataset` with Energon's DefaultTaskEncoder, with no qvl code; qvl's loader reads the crude config, and a
dataset written before the typed config (crude `dataset.yaml`) still loads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qvl.data.write import CRUDE_CONFIG

ENERGON = str(Path(sys.executable).with_name("energon"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """A small prepared dataset (8 samples with images) and the tiny checkpoint whose tokenizer it used."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main

    root = tmp_path_factory.mktemp("energon-tools")
    jsonl, media = write_sample_dataset(root / "samples", count=8, with_bad=False)
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen2_5_vl")
    argv = ["data", "prepare", "--input", str(jsonl), "--media-root", str(media), "--family", "qwen2_5_vl"]
    assert main(argv + ["--hf-path", str(hf), "--seq-length", "256", "--output", str(root / "data")]) == 0
    return root / "data", hf


def test_energon_info_reads_the_dataset(prepared):
    done = subprocess.run([ENERGON, "info", str(prepared[0])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "InterleavedSample" in done.stdout and "`train`: 100%" in done.stdout, done.stdout


def test_energon_lint_passes_on_every_split(prepared):
    done = subprocess.run([ENERGON, "lint", str(prepared[0])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "failed" not in (done.stdout + done.stderr).lower()


def test_energon_public_api_loads_it_without_qvl(prepared):
    """A separate interpreter that never imports qvl: Energon's loader, sample type and default task encoder."""
    script = textwrap.dedent(
        f"""
        import sys
        from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset
        dataset = get_train_dataset({str(prepared[0])!r}, batch_size=1, shuffle_buffer_size=None,
            max_samples_per_sequence=None, task_encoder=DefaultTaskEncoder(),
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        batch = next(iter(get_loader(dataset)))
        sequence = batch.sequence[0]
        texts = [s for s in sequence if isinstance(s, str)]
        images = [s for s in sequence if not isinstance(s, str)]
        assert texts and all(t.split() and t.replace(" ", "").isdigit() for t in texts), texts
        assert images and all(i.ndim == 3 and i.shape[0] == 3 for i in images), [i.shape for i in images]
        assert not [m for m in sys.modules if m == "qvl" or m.startswith("qvl.")]
        print(len(texts), len(images))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_qvl_loader_uses_the_crude_config_and_old_datasets_still_load(prepared, tmp_path):
    """qvl's task encoder reads the same shards through the crude config; a dataset whose dataset.yaml is the
    crude config itself (written before the typed one existed) loads the same packs."""
    import shutil

    from megatron.energon import WorkerConfig
    from megatron.energon.savable_loader import BasicDataLoader

    from qvl.data.encode import QwenVLPackedTaskEncoder
    from qvl.data.load import energon_train_dataset

    data, hf = prepared
    old = tmp_path / "old"
    shutil.copytree(data, old)
    meta = old / ".nv-meta"
    (meta / "dataset.yaml").write_text((meta / CRUDE_CONFIG).read_text())
    (meta / CRUDE_CONFIG).unlink()
    (meta / "sample_loader.py").unlink()
    worker = WorkerConfig(rank=0, world_size=1, num_workers=0)
    encoder = QwenVLPackedTaskEncoder(hf_path=hf, family="qwen2_5_vl")
    first = []
    for path in (data, old):
        dataset = energon_train_dataset(path, encoder, micro_batch_size=1, worker=worker)
        batch = next(iter(BasicDataLoader(dataset, gc_collect_every_n_steps=0)))
        first.append(batch.tokens)
    assert first[0].equal(first[1])
