"""Checkpoint tensors kept aside at import, so an export never loses them.

Released Qwen3.5-VL checkpoints hold multi-token-prediction weights (`mtp.*`). transformers' classes skip them on
load; qvl converts them into Megatron-Core's MTP block (qvl.bridges.qwen3_5_vl), but a run may train without MTP
layers (recipe option `mtp=false`), and its checkpoints then hold no MTP weights. So `qvl convert import` also
copies them bit for bit into the Megatron checkpoint's `hf/` folder (UNCONVERTED_FILE), `qvl convert export` writes
back those the model did not export itself (listed in the safetensors index, so tools that read MTP heads find
them), and `qvl convert verify` reports them as kept aside after comparing them with the HF checkpoint's. Which
prefixes a family has is in its record (`Family.unconverted_prefixes`).
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
# The HF checkpoint's tensor names, so an export writes the layout it came in (e.g. Qwen3.6's packed MoE experts,
# which nothing in its config.json tells apart from Qwen3.5's per-expert ones).
TENSOR_NAMES_FILE = "tensor_names.json"
_INDEX = "model.safetensors.index.json"
BOOKKEEPING_FILES = (UNCONVERTED_FILE, TENSOR_NAMES_FILE)  # the `hf/` folder's own: an export writes what it needs


def unconverted_prefixes(hf_path: Path) -> tuple[str, ...]:
    """The tensor-name prefixes the checkpoint's family keeps aside (none for a family without them)."""
    architectures = read_config(Path(hf_path)).get("architectures") or [""]
    family = family_of_architecture(architectures[0])
    return family.unconverted_prefixes if family is not None else ()


def _weight_files(hf_path: Path) -> list[Path]:
    return sorted(p for p in Path(hf_path).glob("*.safetensors") if p.name != UNCONVERTED_FILE)


def save_tensor_names(hf_path: Path, side_dir: Path) -> None:
    """Record the checkpoint's tensor names in `side_dir`/TENSOR_NAMES_FILE."""
    names = []
    for path in _weight_files(hf_path):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    side_dir.mkdir(parents=True, exist_ok=True)
    (side_dir / TENSOR_NAMES_FILE).write_text(json.dumps(sorted(names)))


def recorded_tensor_names(hf_config) -> list[str] | None:
    """The tensor names recorded beside the config a bridge was built from (`qvl convert import`'s `hf/` folder),
    or None."""
    path = Path(getattr(hf_config, "name_or_path", "") or ".") / TENSOR_NAMES_FILE
    return json.loads(path.read_text()) if path.is_file() else None


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
    """Write the kept-aside tensors the export did not write itself (a model trained without MTP layers) next to an
    exported checkpoint's weights and list them in its index; returns their names."""
    source = Path(side_dir) / UNCONVERTED_FILE
    if not source.is_file():
        return []
    out_hf_path = Path(out_hf_path)
    index_path = out_hf_path / _INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # one weights file and no index: an index that names both files
        index = {"metadata": {}, "weight_map": {}}
        for path in _weight_files(out_hf_path):
            with safe_open(str(path), framework="pt") as f:
                index["weight_map"].update({name: path.name for name in f.keys()})
    with safe_open(str(source), framework="pt") as f:
        missing = {name: f.get_tensor(name) for name in sorted(f.keys()) if name not in index["weight_map"]}
    if not missing:
        return []
    save_file(missing, str(out_hf_path / UNCONVERTED_FILE), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(missing, UNCONVERTED_FILE))
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    return sorted(missing)


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
