"""The Megatron-Bridge dataset hooks: train loaders over a `qvl data prepare` dataset for `pretrain()/finetune()`,
of conversations (`build_packed_datasets`) or of preference pairs (`build_preference_datasets`)."""

from __future__ import annotations

import pathlib
from typing import Any

from qvl.data.encode import QwenVLPackedTaskEncoder
from qvl.data.planned import PlannedPackLoader, read_dp_plan
from qvl.data.preference_encode import PreferenceTaskEncoder
from qvl.data.write import CRUDE_CONFIG


def build_packed_datasets(config: Any, context: Any) -> tuple[Any, None, None]:
    """Megatron-Bridge DatasetProvider hook: the train loader over a `qvl data prepare` dataset.

    Each data-parallel rank reads its own share: the DP-aware pack plan's (rank, step) order when the
    dataset has one else Energon's savable loader in file order (no shuffle buffer, so runs
    repeat exactly). Both resume at the saved stream position through Megatron-Bridge's checkpointing.
    """
    encoder = QwenVLPackedTaskEncoder(hf_path=pathlib.Path(config.hf_path), family=config.family)
    return train_loader(config, encoder), None, None


def build_preference_datasets(config: Any, context: Any) -> tuple[Any, None, None]:
    """Megatron-Bridge DatasetProvider hook for a dataset of preference pairs: as `build_packed_datasets`, with
    batches that say which sub-sequences pair up and, where `config.reference` names a reference folder (None:
    none), each side's reference log-prob (qvl.data.preference_encode)."""
    reference = None if config.reference is None else pathlib.Path(config.reference)
    encoder = PreferenceTaskEncoder(hf_path=pathlib.Path(config.hf_path), family=config.family, reference=reference)
    return train_loader(config, encoder), None, None


def train_loader(config: Any, encoder: QwenVLPackedTaskEncoder) -> Any:
    """This data-parallel rank's train loader over `config.path` through `encoder` (planned, else Energon's)."""
    from megatron.core import parallel_state

    path = pathlib.Path(config.path)
    rank, world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if read_dp_plan(path):
        return PlannedPackLoader(
            path,
            encoder,
            rank=rank,
            data_parallel=world,
            global_batch_size=_megatron_global_batch(),
            micro_batch_size=config.micro_batch_size,
            num_workers=config.num_workers,
        )
    from megatron.bridge.data.energon.base_energon_datamodule import EnergonDataloader  # Megatron-Bridge
    from megatron.energon import SavableDataLoader, WorkerConfig

    worker = WorkerConfig(rank=rank, world_size=world, num_workers=config.num_workers)
    dataset = energon_train_dataset(path, encoder, micro_batch_size=config.micro_batch_size, worker=worker)
    # Energon's loader collects garbage every few batches, and by default freezes what exists first and unfreezes
    # *everything* after the loop: in this process (no workers) that would hand back to every later collection the
    # millions of import-time objects qvl froze (foundation.megatron.gc_paused), ~0.3-0.8 s a collection after the
    # first run in a process. Workers are processes of their own, where Energon's freeze is what saves the
    # copy-on-write of the inherited heap.
    return EnergonDataloader(SavableDataLoader(dataset, gc_freeze_at_start=config.num_workers > 0))


def energon_train_dataset(path: pathlib.Path, encoder: Any, *, micro_batch_size: int, worker: Any) -> Any:
    """Energon's train dataset of packs in file order (no shuffle buffer, so runs repeat exactly), read through
    qvl's crude config where the dataset has one (its dataset.yaml is then the typed view for Energon's own tools);
    a dataset written before that has the crude config as its dataset.yaml."""
    from megatron.energon import get_train_dataset

    crude = pathlib.Path(path) / ".nv-meta" / CRUDE_CONFIG
    return get_train_dataset(
        str(path),
        batch_size=micro_batch_size,
        task_encoder=encoder,
        worker_config=worker,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        **({"dataset_config": CRUDE_CONFIG} if crude.is_file() else {}),
    )


def _megatron_global_batch() -> int | None:
    """The training loop's global batch size (packs per optimizer step), or None outside a training loop."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    try:
        return get_current_global_batch_size()
    except AttributeError:  # the calculator is a module global that stays None until a training loop sets it up
        return None
