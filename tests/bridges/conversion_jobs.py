"""Rank functions for the conversion tests: import or verify every family inside one set of processes,
so the tests pay for process start-up and imports once."""

from __future__ import annotations

from pathlib import Path

from qvl.bridges import convert


def import_all(hf_paths: dict[str, str], out_root: str) -> None:
    """In one process: stream every family's HF checkpoint into a Megatron checkpoint (fp32)."""
    for family, hf_path in hf_paths.items():
        convert.import_checkpoint(Path(hf_path), Path(out_root) / family, dtype="fp32")


def verify_all(hf_paths: dict[str, str], out_root: str) -> dict[str, dict | None]:
    """On each rank: load every family's checkpoint at the current TP/PP layout and verify it; reports by family."""
    return {
        family: convert.verify_on_rank(hf_path, str(Path(out_root) / family), tolerance=None, video=True)
        for family, hf_path in hf_paths.items()
    }


def export_all(megatron_root: str, names: list[str], out_root: str) -> None:
    """On each rank: export every named Megatron checkpoint under `megatron_root` to HF under `out_root`."""
    for name in names:
        convert.export_checkpoint(Path(megatron_root) / name, Path(out_root) / name)


def import_materialised(hf_path: str, out_dir: str, dtype: str) -> None:
    """The reference: Megatron-Bridge's own import (whole model built, loaded, then saved), qvl's provider fixes."""
    import torch

    bridge = convert.auto_bridge_with_weights(Path(hf_path), convert.DTYPES[dtype])
    provider = bridge.to_megatron_provider(load_weights=True)
    convert._fix(provider, bridge)
    provider.params_dtype = provider.pipeline_dtype = convert.DTYPES[dtype]
    provider.bf16, provider.fp16 = dtype == "bf16", dtype == "fp16"
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf_path, low_memory_save=True)
    torch.distributed.barrier()


def import_both_ways(jobs: list[tuple[str, str, str]]) -> None:
    """Per (hf_path, out_dir, dtype): qvl's streamed import into OUT/stream, Megatron-Bridge's into OUT/reference."""
    for hf_path, out_dir, dtype in jobs:
        convert.import_checkpoint(Path(hf_path), Path(out_dir) / "stream", dtype=dtype)
        import_materialised(hf_path, str(Path(out_dir) / "reference"), dtype)
