"""Checkpoint tensors qvl does not convert, carried through a round trip untouched.

Released Qwen3.5-VL checkpoints hold multi-token-prediction weights (`mtp.*`). transformers' classes skip them on
load, and Megatron-Bridge maps them only into a model built with MTP layers, which qvl's local (non-TE) specs do
not build. Instead of dropping them, `qvl convert import` copies them bit for bit into the Megatron checkpoint's
`hf/` folder (UNCONVERTED_FILE), `qvl convert export` writes them back next to the exported weights (listed in
the safetensors index, so tools that read MTP heads find them), and `qvl convert verify` reports them as kept aside
after comparing them with the HF checkpoint's. Which prefixes a family has is in its record
(`Family.unconverted_prefixes`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qvl.bridges.consistency import read_config
from qvl.foundation.families import family_of_architecture

UNCONVERTED_FILE = "unconverted.safetensors"
_INDEX = "model.safetensors.index.json"


def unconverted_prefixes(hf_path: Path) -> tuple[str, ...]:
    """The tensor-name prefixes the checkpoint's family keeps aside (none for a family without them)."""
    architectures = read_config(Path(hf_path)).get("architectures") or [""]
    family = family_of_architecture(architectures[0])
    return family.unconverted_prefixes if family is not None else ()


def _weight_files(hf_path: Path) -> list[Path]:
    return sorted(p for p in Path(hf_path).glob("*.safetensors") if p.name != UNCONVERTED_FILE)


def save_unconverted(hf_path: Path, side_dir: Path) -> list[str]:
    """Copy the checkpoint's kept-aside tensors into `side_dir`/UNCONVERTED_FILE; returns their names."""
    prefixes = unconverted_prefixes(hf_path)
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(hf_path) if prefixes else []:
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(prefixes)})
    if tensors:
        side_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(side_dir / UNCONVERTED_FILE), metadata={"format": "pt"})
    return sorted(tensors)


def restore_unconverted(side_dir: Path, out_hf_path: Path) -> list[str]:
    """Write the kept-aside tensors next to an exported checkpoint's weights and list them in its index."""
    source = Path(side_dir) / UNCONVERTED_FILE
    if not source.is_file():
        return []
    out_hf_path = Path(out_hf_path)
    (out_hf_path / UNCONVERTED_FILE).write_bytes(source.read_bytes())
    index_path = out_hf_path / _INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # one weights file and no index: an index that names both files
        index = {"metadata": {}, "weight_map": {}}
        for path in _weight_files(out_hf_path):
            with safe_open(str(path), framework="pt") as f:
                index["weight_map"].update({name: path.name for name in f.keys()})
    with safe_open(str(source), framework="pt") as f:
        names = sorted(f.keys())
    index["weight_map"].update({name: UNCONVERTED_FILE for name in names})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    return names


def sort_out_kept(different: list[str], hf_path: Path, side_dir: Path) -> tuple[list[str], list[str]]:
    """Split verify's differences into (kept aside and bit-identical to the HF checkpoint's, still different)."""
    source = Path(side_dir) / UNCONVERTED_FILE
    suffix = " (never exported)"
    missing = [d[: -len(suffix)] for d in different if d.endswith(suffix)]
    if not missing or not source.is_file():
        return [], different
    reference: dict[str, torch.Tensor] = {}
    for path in _weight_files(hf_path):
        with safe_open(str(path), framework="pt") as f:
            reference.update({name: f.get_tensor(name) for name in f.keys() if name in missing})
    with safe_open(str(source), framework="pt") as f:
        kept = sorted(n for n in f.keys() if n in reference and torch.equal(f.get_tensor(n), reference[n]))
    return kept, [d for d in different if not (d.endswith(suffix) and d[: -len(suffix)] in kept)]
