"""The DP-planned loader: one data-parallel rank's packs of a `--data-parallel` plan, in plan order.

`qvl data prepare --data-parallel D --global-batch-size G` schedules packs into (step, rank, slot) so every rank's
vision + text cost is balanced (qvl.data.balance); this loader serves a rank exactly its share, resumably.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import tarfile

import torch

from qvl.data.encode import PackedBatch, QwenVLPackedTaskEncoder, cook_pack
from qvl.foundation.errors import DataError


def read_dp_plan(path: pathlib.Path) -> dict | None:
    """report.json's `dp_plan`, or None; datasets written before the key was `global_batch_size` still read."""
    plan = json.loads((path / "report.json").read_text()).get("dp_plan") if (path / "report.json").is_file() else None
    if plan and "global_batch" in plan:
        plan["global_batch_size"] = plan.pop("global_batch")
    return plan


def check_plan(path: pathlib.Path, plan: dict, *, data_parallel: int, global_batch_size: int | None, what: str) -> None:
    """Refuse a data-parallel size or global batch other than the ones the dataset's pack plan was made for.

    A plan for D ranks read at fewer ranks never serves the packs planned for the others (data silently
    unused); read at more, or with another global batch, the (step, rank) schedule no longer matches the steps."""
    planned = (plan["data_parallel"], plan["global_batch_size"])
    asked = (data_parallel, planned[1] if global_batch_size is None else global_batch_size)
    if asked != planned:
        raise DataError(
            f"{what} at data_parallel={asked[0]}, global_batch_size={asked[1]}, but {path} was planned for "
            f"data_parallel={planned[0]}, global_batch_size={planned[1]} (report.json dp_plan); re-plan it with "
            f"`qvl data prepare ... --data-parallel {asked[0]} --global-batch-size {asked[1]}`, or train at "
            f"data_parallel={planned[0]} with global_batch_size={planned[1]}"
        )


class PackMicroBatches(torch.utils.data.Dataset):
    """Micro-batch `i` of a list of (pack, shard) read straight from the tar shards (wrapping past the end): what a
    loader worker encodes, for one rank's plan order or a pass over chosen packs (qvl.training.reference)."""

    def __init__(self, path: pathlib.Path, encoder: QwenVLPackedTaskEncoder, packs: list, micro_batch_size: int):
        self.path, self.encoder, self.packs, self.micro_batch_size = path, encoder, packs, micro_batch_size
        self._offsets: dict[str, dict[str, tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self.packs) // self.micro_batch_size

    def __getitem__(self, index: int) -> PackedBatch:
        first = index * self.micro_batch_size
        picks = [self.packs[(first + k) % len(self.packs)] for k in range(self.micro_batch_size)]
        return self.encoder.batch([self.encoder.encode_sample(cook_pack(self._read(*pick))) for pick in picks])

    def _read(self, pack: int, shard: str) -> dict:
        key = f"{pack:09d}"
        sample = {"__key__": key, "__restore_key__": ("planned", shard, pack)}
        with (self.path / shard).open("rb") as f:
            for name, (offset, size) in self._members(shard).items():
                if name.startswith(key + "."):
                    f.seek(offset)
                    sample[name[len(key) + 1 :]] = f.read(size)
        return sample

    def _members(self, shard: str) -> dict[str, tuple[int, int]]:
        if shard not in self._offsets:
            with tarfile.open(self.path / shard) as tar:
                self._offsets[shard] = {m.name: (m.offset_data, m.size) for m in tar.getmembers()}
        return self._offsets[shard]


def _as_is(batch: PackedBatch) -> PackedBatch:
    return batch


class PlannedPackLoader:
    """Serves one data-parallel rank its packs of a `--data-parallel` plan, in plan order, as micro-batches.

    Energon shards a dataset by position, which would ignore the plan; this reads packs.jsonl's (step, rank, slot)
    and the tar shards directly. Each step gives this rank global_batch_size / data_parallel packs in
    `micro_batch_size` groups; after the last step it starts again at step 0. It refuses a data-parallel size or
    global batch other than the plan's (`check_plan`). With `num_workers` > 0, worker processes decode, resize and
    patchify the next `prefetch` micro-batches per worker while the GPU computes (a torch DataLoader over
    micro-batch indices, in order). `save_state()` / `restore_state(state)` (the names Megatron-Bridge's
    checkpointing calls) count micro-batches handed out, not prefetched
    ones, so a resume continues at exactly the next micro-batch whatever the worker count.
    """

    def __init__(
        self,
        path: pathlib.Path,
        task_encoder: QwenVLPackedTaskEncoder,
        *,
        rank: int,
        data_parallel: int,
        global_batch_size: int | None = None,
        micro_batch_size: int = 1,
        num_workers: int = 0,
        prefetch: int = 4,
    ):
        self.path, self.micro_batch_size = pathlib.Path(path), micro_batch_size
        self.num_workers, self.prefetch = num_workers, prefetch
        rows = [json.loads(line) for line in (self.path / "packs.jsonl").read_text().splitlines()]
        self.plan = read_dp_plan(self.path)
        if self.plan is None or "step" not in rows[0]:
            raise DataError(f"{self.path} has no DP plan; prepare it with --data-parallel D --global-batch-size G")
        check_plan(
            self.path, self.plan, data_parallel=data_parallel, global_batch_size=global_batch_size, what="training"
        )
        if not 0 <= rank < data_parallel or self.plan["packs_per_rank_per_step"] % micro_batch_size:
            raise DataError(
                f"rank {rank} / micro_batch_size {micro_batch_size} do not fit the plan's "
                f"{self.plan['data_parallel']} ranks x {self.plan['packs_per_rank_per_step']} packs per step; "
                "use a micro_batch_size that divides the packs per rank per step"
            )
        mine = sorted(
            (r["step"], r["slot"], r["pack"], r["shard"]) for r in rows if r["rank"] == rank and r["step"] >= 0
        )
        self.packs = [(pack, shard) for _, _, pack, shard in mine]
        self.micro_batches = PackMicroBatches(self.path, task_encoder, self.packs, micro_batch_size)
        self.position = 0  # micro-batches handed out
        self._stream = None

    def __iter__(self):
        return self

    def __next__(self) -> PackedBatch:
        if self.num_workers == 0:
            batch = self.micro_batches[self.position]
        else:
            if self._stream is None:
                self._stream = iter(self._worker_loader(self.position))
            batch = next(self._stream)
        self.position += 1
        return batch

    def _worker_loader(self, start: int) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            self.micro_batches,
            batch_size=None,
            sampler=itertools.count(start),  # endless, in order: the plan wraps to step 0 after its last step
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch,
            collate_fn=_as_is,
        )

    def save_state(self) -> dict:
        """Where this rank's stream stands (micro-batches served so far) and the plan it was served from."""
        return {
            "position": self.position,
            "micro_batch_size": self.micro_batch_size,
            "data_parallel": self.plan["data_parallel"],
            "global_batch_size": self.plan["global_batch_size"],
        }

    def restore_state(self, state: dict) -> None:
        """Continue at the saved position; refuses a state saved under another DP size, global batch or micro-batch."""
        if "data_parallel" in state:
            check_plan(
                self.path,
                self.plan,
                data_parallel=int(state["data_parallel"]),
                global_batch_size=int(state.get("global_batch_size", state.get("global_batch"))),
                what="the checkpoint being resumed was trained",
            )
        if int(state.get("micro_batch_size", self.micro_batch_size)) != self.micro_batch_size:
            raise DataError(
                f"the checkpoint's data position counts micro-batches of {state['micro_batch_size']} packs, this run's "
                f"are {self.micro_batch_size}; resume with micro_batch_size={state['micro_batch_size']}"
            )
        self.position = int(state["position"])
        self.close()

    def close(self) -> None:
        """Stop the worker processes (a later next() starts them again at the current position)."""
        self._stream = None
