"""The streamed import writes the checkpoint Megatron-Bridge's own import writes: same keys, global shapes,
dtypes and chunks in the torch_dist metadata, and bit-identical tensors, for every family (dense and MoE)
converted from fp32 to bf16, and for MoE (the grouped-expert path) also kept in fp32. Its memory is in test_memory.py; that it trains and exports is in test_conversion.py
and tests/training/test_train.py."""

from __future__ import annotations

import pytest
import torch

from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.foundation.distributed import run_on_ranks
from qvl.foundation.families import FAMILIES
from tests.bridges import conversion_jobs


def _read(path) -> tuple[dict, dict]:
    """A torch_dist directory's per-key metadata and its tensors, read with PyTorch's own reader."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return metadata, tensors


def _layout(entry) -> tuple:
    if not hasattr(entry, "size"):
        return ("bytes",)
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
    return tuple(entry.size), entry.properties.dtype, chunks


# (family, dtype) pairs, all converted in one process (conversion_jobs.import_both_ways).
CASES = [(family, "bf16") for family in FAMILIES] + [("qwen3_vl_moe", "fp32")]


@pytest.mark.slow  # more than ~20 s on 2 cores
def test_streamed_checkpoint_equals_megatron_bridge_import(tmp_path):
    hf_paths = {family: str(write_tiny_hf_checkpoint(tmp_path / "hf" / family, family, seed=3)) for family in FAMILIES}
    jobs = [(hf_paths[family], str(tmp_path / "out" / f"{family}-{dtype}"), dtype) for family, dtype in CASES]
    run_on_ranks(conversion_jobs.import_both_ways, jobs, cpu=True)
    for (family, dtype), (_, out, _) in zip(CASES, jobs):
        ours_meta, ours = _read(f"{out}/stream/iter_0000000")
        ref_meta, ref = _read(f"{out}/reference/iter_0000000")
        assert ours_meta.keys() == ref_meta.keys(), family
        layout_differs = [k for k in ref_meta if _layout(ours_meta[k]) != _layout(ref_meta[k])]
        assert not layout_differs, (family, layout_differs[:5])
        assert len(ref) > 30, (family, len(ref))  # the tensors really were compared
        different = [k for k in ref if not torch.equal(ours[k], ref[k])]
        assert not different, (family, dtype, different[:5])
        expected = torch.float32 if dtype == "fp32" else torch.bfloat16
        assert sum(t.dtype == expected for t in ours.values()) > len(ours) // 2, (family, dtype)


def test_safetensors_reader_matches_safetensors_and_names_bad_files(tmp_path):
    from safetensors.torch import load_file, save_file

    from qvl.bridges.convert import ConversionError
    from qvl.bridges.stream import SafetensorsFiles

    tensors = {
        "a": torch.randn(3, 5, dtype=torch.float32),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.ones(2, dtype=torch.bool),
    }
    save_file(tensors, tmp_path / "one.safetensors")
    save_file({"e": torch.randn(4, 4).half()}, tmp_path / "two.safetensors")
    reader = SafetensorsFiles(tmp_path)
    expected = load_file(tmp_path / "one.safetensors") | load_file(tmp_path / "two.safetensors")
    assert set(reader.keys()) == set(expected)
    for name, tensor in expected.items():
        assert reader[name].dtype == tensor.dtype and torch.equal(reader[name], tensor), name
        assert reader[name].untyped_storage().resizable()  # the streaming planner frees it once written
    with pytest.raises(KeyError, match="missing.weight is in none"):
        reader["missing.weight"]
    data = (tmp_path / "two.safetensors").read_bytes()
    (tmp_path / "two.safetensors").write_bytes(data[:-8])
    with pytest.raises(OSError, match="ends inside tensor e"):
        SafetensorsFiles(tmp_path)["e"]
    empty = tmp_path / "bin-only"
    empty.mkdir()
    with pytest.raises(ConversionError, match="no \\*.safetensors weights"):
        SafetensorsFiles(empty)
