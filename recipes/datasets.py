"""The datasets a recipe trains on, as Megatron-Bridge dataset providers, and the checks where a dataset meets its recipe:
packed conversations (`qvl data prepare`) for pretraining, SFT and PEFT; packed preference pairs with their reference
log-probs for the preference stages (qvl.recipes.preference)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qvl.bridges.checkpoints import has_checkpoint
from qvl.data.planned import check_plan, read_dp_plan
from qvl.foundation.errors import DataError
from qvl.foundation.megatron import import_megatron_bridge
from qvl.recipes.architectures import Architecture
from qvl.recipes.options import RecipeOptions, check_data_folder
from qvl.recipes.preference import PreferenceConfig, check_preference_dataset, reference_dir

import_megatron_bridge()

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider  # noqa: E402


# Not slots: Megatron-Bridge's DatasetProvider base is a plain dataclass with a __dict__.
@dataclass(kw_only=True)
class QvlPackedDatasetConfig(DatasetProvider):
    """A `qvl data prepare` dataset: offline-packed THD sequences read by qvl.data.encode's task encoder."""

    path: str | None  # None only while planning; finalize() refuses it
    hf_path: str  # the checkpoint whose image processor and tokenizer the task encoder loads
    family: str  # qvl.data family name (qwen2_vl, qwen2_5_vl, qwen3_vl)
    seq_length: int
    micro_batch_size: int = 1
    dataloader_type: str | None = "external"  # energon yields batches itself
    num_workers: int = 2

    def finalize(self) -> None:
        """Refuse a missing dataset before any process group or model is built."""
        super().finalize()
        check_dataset(self)

    def tower_calls_dataset(self) -> str | None:
        """The prepared folder whose packs.jsonl lists this loader's vision tower calls (each pack's images, videos:
        they plan a graphed tower's bucket sizes, qvl.kernels.tower_buckets): its own where a micro-batch is one
        pack; None where micro-batches hold several."""
        return self.path if self.micro_batch_size == 1 else None

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any, Any, Any]:
        """Train/valid/test loaders, built by qvl.data.load (wired by the training loop)."""
        from qvl.data.load import build_packed_datasets  # Energon is imported only when data is loaded

        return build_packed_datasets(self, context)


@dataclass(kw_only=True)
class QvlPreferenceDatasetConfig(QvlPackedDatasetConfig):
    """A `qvl data prepare` dataset of preference pairs, read with the reference log-probs `qvl reference` wrote
    (`reference`, a folder; None where the stage needs none or while the reference itself is computed)."""

    reference: str | None = None

    def finalize(self) -> None:
        """Refuse a missing dataset or one of SFT conversations before any process group or model is built."""
        super().finalize()
        check_preference_dataset(self.path)

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any, Any, Any]:
        """Train loader of pairs (qvl.data.preference_encode), with the reference's columns where there is one."""
        from qvl.data.load import build_preference_datasets  # Energon is imported only when data is loaded

        return build_preference_datasets(self, context)


def check_dataset(dataset: Any) -> None:
    """Refuse a missing dataset, or a folder that `qvl data prepare` did not write, naming the option to fix."""
    if isinstance(dataset, QvlPackedDatasetConfig):
        check_data_folder(dataset.path)


def check_dataset_matches_recipe(config: Any) -> None:
    """Refuse a dataset prepared for another family, with longer packs than the recipe's `seq_length`, or with a
    DP plan for another data-parallel size or global batch (report.json), naming the fix."""
    dataset = config.dataset
    if not isinstance(dataset, QvlPackedDatasetConfig) or dataset.path is None:
        return
    path = Path(dataset.path)
    report = json.loads((path / "report.json").read_text()) if (path / "report.json").is_file() else {}
    family = report.get("family")
    if family and family != dataset.family:
        raise DataError(
            f"data={path} was prepared for {family}, but this recipe trains {dataset.family}; prepare it again "
            f"with `qvl data prepare --family {dataset.family} ...` or train a {family} recipe"
        )
    packed, recipe_length = report.get("seq_length"), config.model.seq_length
    if packed and packed > recipe_length:
        raise DataError(
            f"data={path} holds packs of up to {packed} tokens, longer than the recipe's seq_length={recipe_length}; "
            f"train with seq_length={packed} or prepare the data again with --seq-length {recipe_length}"
        )
    plan = read_dp_plan(path)
    if plan and config.data_parallel_size is not None:
        check_plan(
            path,
            plan,
            data_parallel=config.data_parallel_size,
            global_batch_size=config.train.global_batch_size,
            what="this run trains",
        )


def check_reference_matches(config: Any) -> None:
    """A preference run's precomputed reference must have been computed over its dataset from its starting
    checkpoint (qvl.data.reference): refuse a missing or stale one, naming both and the command that computes it."""
    dataset = config.dataset
    if not isinstance(dataset, QvlPreferenceDatasetConfig) or not dataset.reference or dataset.path is None:
        return
    if config.checkpoint.load and has_checkpoint(Path(config.checkpoint.load)):
        return  # resuming: the run checked its reference when it started
    from qvl.data.reference import check_reference

    check_reference(
        dataset.reference,
        data=dataset.path,
        checkpoint=config.checkpoint.pretrained_checkpoint,
        recipe="RECIPE",
    )


def build_dataset(arch: Architecture, o: RecipeOptions, preference: PreferenceConfig | None) -> QvlPackedDatasetConfig:
    """The stage's dataset: packed conversations, or packed pairs with the reference the preference stage reads."""
    common = dict(path=o.data, hf_path=o.hf_path, family=arch.family, seq_length=o.seq_length,
                  micro_batch_size=o.micro_batch_size)  # fmt: skip
    if preference is None:
        return QvlPackedDatasetConfig(**common)
    reference = reference_dir(o) if preference.reference == "precomputed" else None
    return QvlPreferenceDatasetConfig(**common, reference=None if reference is None else str(reference))
