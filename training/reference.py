"""`qvl reference RECIPE [key=value ...]`: a preference recipe's reference log-probs, computed ahead over its dataset.

DPO compares the policy with the model it starts from (the SFT result, the recipe's `pretrained_checkpoint`). qvl
runs that model once over the prepared dataset, forward only, before training, and writes each side's summed
log-prob beside the packs (qvl.data.reference: `DATA/reference/` unless `reference=DIR`); training reads them with
the packs, so the reference costs no memory and no time there (NeMo-RL instead swaps a CPU copy of the weights in
every step; ms-swift keeps a second model on the GPU).

The pass builds the recipe's model at the recipe's layout through Megatron-Bridge's own `setup()` (process groups,
provider, the pretrained checkpoint loaded as a fine-tune loads it; an adapter recipe's reference is its base model,
its adapters not built) and runs Megatron-Core's forward-only schedule over packs: each data-parallel replica reads
every DP-th pack of packs.jsonl, its last pipeline stage sums each sub-sequence's learned-token log-probs (the same
per-token losses and segment sums as the training step: qvl.training.preference) and appends them to its own file.
Killed at any point, the same command resumes where each replica stopped; when every pack is done, one rank writes the
table and its source (dataset and checkpoint fingerprints) and a training run refuses any other pairing.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qvl.data.reference import ReferenceSource, read_source, write_reference
from qvl.foundation import megatron, runtime
from qvl.foundation.distributed import forget_model_parallel_leftovers
from qvl.foundation.errors import ConfigError
from qvl.foundation.rendezvous import rendezvous_environment
from qvl.kernels import switch
from qvl.training.loop import TrainRequest, check_writable, prepare_config, release_run

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0  # seconds between progress lines


@dataclass(kw_only=True, slots=True)
class ReferenceRun:
    """Where a reference pass reads and writes, and what it is computed from."""

    data: Path
    out: Path
    source: ReferenceSource

    @property
    def partial(self) -> Path:
        """Each replica's rows while the pass runs (a folder beside the table's)."""
        return self.out.with_name(self.out.name + ".partial")


def run_reference(request: TrainRequest) -> Path:
    """`qvl reference`: the recipe's config as `qvl train` builds it, its reference computed (or found up to date)."""
    cpu = request.device == "cpu" or not torch.cuda.is_available()
    if cpu:
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    info, config = prepare_config(request)
    run = reference_run(info.name, config)
    if read_source(run.out) == run.source:
        logger.info("reference %s is up to date (same dataset and checkpoint)", run.out)
        return run.out
    check_writable("reference", run.out)
    compute_reference(config, run, device="cpu" if cpu else "auto")
    return run.out


def reference_run(recipe: str, config: Any) -> ReferenceRun:
    """The reference pass of a preference config: refuse a recipe that needs none or has nothing to start from."""
    settings = getattr(config.qvl, "preference", None)
    if settings is None or settings.reference != "precomputed":
        kind = "not a preference recipe" if settings is None else f"reference={settings.reference}"
        raise ConfigError(f"`qvl reference` computes a precomputed reference; recipe {recipe} is {kind}")
    checkpoint = config.checkpoint.pretrained_checkpoint
    if not checkpoint:
        raise ConfigError(
            f"recipe {recipe}'s reference is its starting model: pass pretrained_checkpoint=DIR (the SFT run's "
            "checkpoints/ or a `qvl convert import` folder)"
        )
    data = Path(config.dataset.path)
    return ReferenceRun(data=data, out=Path(config.dataset.reference), source=ReferenceSource.of(data, checkpoint))


def compute_reference(config: Any, run: ReferenceRun, *, device: str = "auto") -> None:
    """Build the model at the config's layout, load its pretrained checkpoint and run the forward-only pass."""
    if device == "cpu" or not torch.cuda.is_available():
        runtime.activate(force=True)
        runtime.enable_bridge_training()
        runtime.cpu_training_config(config)
    megatron.import_megatron_bridge()
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.state import GlobalState
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)

    config.peft = None  # the reference is the base model: adapters start as zero updates anyway
    config.checkpoint.load = None  # never the preference run's own checkpoints
    config.checkpoint.save = None
    config.dataset.reference = None  # the reference being computed is not read
    config._checkpoint_load_required = True
    should_destroy = not torch.distributed.is_initialized()
    destroy_rerun_state_machine()
    with rendezvous_environment(), switch.applied_for_training(switch.Target.of(config)):
        runtime_config_update(config)
        state = GlobalState()
        state.cfg = config
        built = setup(state, _no_datasets)
        try:
            _forward_pass(config, built.model, run)
        finally:
            release_run(built.model, state)  # its DDP model, optimizer and process groups go with the pass
            del built, state
            _teardown(should_destroy)
            gc.collect()


def _no_datasets(*_: Any, **__: Any) -> tuple[None, None, None]:
    """The pass reads its packs itself (`_pack_batches`): setup builds no training loader."""
    return None, None, None


def _teardown(should_destroy: bool) -> None:
    # What Megatron-Bridge's loop tears down when it ends (its _finish_train): the model-parallel groups and the
    # micro-batch calculator too, so a `qvl train` in the same process (a notebook, a test) can initialise its own
    from megatron.bridge.training.initialize import destroy_global_state

    destroy_global_state()
    forget_model_parallel_leftovers()
    if should_destroy and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _forward_pass(config: Any, model: list, run: ReferenceRun) -> None:
    """This replica's packs through the forward-only schedule, rows appended as they come; then the table."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    writer = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    rows_file = run.partial / f"rank-{dp_rank:05d}.jsonl"
    packs = _packs(run.data)
    mine = packs[dp_rank::dp]
    done = _done_packs(rows_file)
    torch.distributed.barrier()  # every rank of the replica read the same rows before the writer appends
    if writer:
        _drop_torn_line(rows_file)
    todo = [pack for pack in mine if pack[0] not in done]
    logger.info("reference pass: %d of this replica's %d packs to go (%d done before)", len(todo), len(mine),
                len(mine) - len(todo))  # fmt: skip
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    # micro-batches per schedule call: enough to fill the pipeline, few enough to append rows often
    per_call = 8 * config.model.pipeline_model_parallel_size
    started, last_line, tokens, timed_packs = None, time.perf_counter(), 0, 0
    if writer:
        rows_file.parent.mkdir(parents=True, exist_ok=True)
    batches = _pack_batches(run.data, config, todo)
    for first in range(0, len(todo), per_call):
        group = [next(batches) for _ in todo[first : first + per_call]]
        iterators = [iter(group) for _ in model]  # one per virtual pipeline chunk
        with torch.no_grad():
            results = forward_backward(
                forward_step_func=partial(_reference_step, config),
                data_iterator=iterators if len(model) > 1 else iterators[0],
                model=model,
                num_microbatches=len(group),
                seq_length=config.model.seq_length,
                micro_batch_size=1,
                forward_only=True,
            )
        if writer:
            _append_rows(rows_file, results)
        if started is None:  # the rate leaves out the first call: loader workers starting, first kernels
            started = time.perf_counter()
        else:
            tokens, timed_packs = tokens + sum(int(b.tokens.numel()) for b in group), timed_packs + len(group)
        if time.perf_counter() - last_line > PROGRESS_EVERY_S or first + per_call >= len(todo):
            elapsed = max(time.perf_counter() - started, 1e-9)
            logger.info("reference pass: %d / %d packs, %.2f packs/s, %.0f tokens/s per replica",
                        min(first + per_call, len(todo)), len(todo), timed_packs / elapsed,
                        tokens / elapsed)  # fmt: skip
            last_line = time.perf_counter()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        _write_table(run, packs, config)
    torch.distributed.barrier()


def _reference_step(config: Any, data_iterator: Iterator, model: Any):
    """Forward step of the pass: a pack through the model, each sub-sequence's summed log-prob collected (the output
    layer at the learned tokens only, as the training step runs it: qvl.kernels.loss_rows)."""
    from qvl.training.preference import pair_layout
    from qvl.training.step import host_batch, loss_rows_arguments, model_inputs, padded_length

    device = next(model.parameters()).device
    batch = next(data_iterator)
    kwargs, loss_mask = model_inputs(batch, device, pad_to=padded_length(config.model, batch.tokens.shape[1]))
    layout = pair_layout(batch, device, padded_to=kwargs["input_ids"].shape[1], precomputed=False)
    rows = loss_rows_arguments(config, batch, device)
    output = model(**kwargs, **rows, host_batch=host_batch(model, batch, kwargs, device))
    subs = len(batch.cu_seqlens_q) - 1
    pack = torch.tensor(list(batch.packs), dtype=torch.float64)
    return output, partial(_collect, layout, loss_mask, subs, pack)


def _collect(layout: Any, loss_mask: torch.Tensor, subs: int, pack: torch.Tensor, output_tensor: torch.Tensor):
    """The pass's "loss": nothing to learn, and the pack's per-sub-sequence log-probs and learned tokens kept."""
    from qvl.training.preference import side_logps

    if isinstance(output_tensor, tuple):
        output_tensor, loss_mask = output_tensor
    # kept on the device: the rows are read once per schedule call (`_append_rows`), not once per micro-batch
    logps = side_logps(output_tensor, loss_mask, layout)[:subs].double()
    zero = output_tensor.new_zeros(())
    row = {"pack": pack, "logp": logps, "tokens": layout.tokens[:subs].double()}
    return zero, torch.tensor(1, dtype=torch.int), row


def _packs(data: Path) -> list[tuple[int, str]]:
    """Every pack of the dataset as (pack id, shard), in packs.jsonl's order."""
    rows = (json.loads(line) for line in (data / "packs.jsonl").read_text().splitlines())
    return [(row["pack"], row["shard"]) for row in rows]


def _done_packs(rows_file: Path) -> set[int]:
    """Packs a killed pass of this replica already wrote (a torn last line is dropped and recomputed)."""
    if not rows_file.is_file():
        return set()
    done = set()
    for line in rows_file.read_text().splitlines():
        try:
            done.add(int(json.loads(line)["pack"]))
        except (json.JSONDecodeError, KeyError):
            continue
    return done


def _drop_torn_line(rows_file: Path) -> None:
    """Cut a line a killed pass left half-written, so the rows appended next start on a line of their own."""
    if not rows_file.is_file():
        return
    text = rows_file.read_bytes()
    if text and not text.endswith(b"\n"):
        rows_file.write_bytes(text[: text.rfind(b"\n") + 1])


def _pack_batches(data: Path, config: Any, packs: list[tuple[int, str]]) -> Iterator[Any]:
    """This replica's packs as micro-batches of one pack, decoded in the dataset config's loader workers."""
    from qvl.data.planned import PackMicroBatches
    from qvl.data.preference_encode import PreferenceTaskEncoder

    encoder = PreferenceTaskEncoder(hf_path=Path(config.dataset.hf_path), family=config.dataset.family)
    source = PackMicroBatches(data, encoder, packs, micro_batch_size=1)
    workers = config.dataset.num_workers if packs else 0
    loader = torch.utils.data.DataLoader(source, batch_size=None, num_workers=workers, collate_fn=_as_is, shuffle=False)
    return iter(loader)


def _as_is(batch: Any) -> Any:
    return batch


def _append_rows(rows_file: Path, results: list[dict]) -> None:
    with rows_file.open("a") as f:
        for row in results:
            pack = int(row["pack"].view(-1)[0])
            f.write(json.dumps({"pack": pack, "logp": row["logp"].tolist(), "tokens": row["tokens"].tolist()}) + "\n")


def _write_table(run: ReferenceRun, packs: list[tuple[int, str]], config: Any) -> None:
    """Every replica's rows into the table; refuses to finish while a pack is missing."""
    rows: dict[int, dict] = {}
    for file in sorted(run.partial.glob("rank-*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[int(row["pack"])] = row
    missing = [pack for pack, _ in packs if pack not in rows]
    if missing:
        raise RuntimeError(f"the reference pass left {len(missing)} packs without log-probs (first {missing[:5]})")
    ordered = [rows[pack] for pack, _ in packs]
    counts = [len(row["logp"]) for row in ordered]
    layout = {
        "tensor_parallel": config.model.tensor_model_parallel_size,
        "pipeline_parallel": config.model.pipeline_model_parallel_size,
        "data_parallel": config.data_parallel_size,
        "precision": "bf16" if config.model.bf16 else "fp32",
    }
    write_reference(
        run.out,
        pack=np.repeat([pack for pack, _ in packs], counts),
        sub=np.concatenate([np.arange(n) for n in counts]),
        logp=np.concatenate([row["logp"] for row in ordered]),
        tokens=np.concatenate([row["tokens"] for row in ordered]).astype(np.int64),
        source=run.source,
        layout=layout,
    )
    shutil.rmtree(run.partial, ignore_errors=True)
    logger.info("reference log-probs of %d packs written to %s", len(packs), run.out)
