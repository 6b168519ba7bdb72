"""Prepare: ingest -> validate -> count (per chunk, in parallel) -> pack (once) -> write (per shard, in parallel).

`prepare(config)` builds the Energon dataset in `config.output` plus `quarantine.jsonl` (one line per rejected
sample), `packs.jsonl` (one line per packed sequence) and `report.json` (counts, tokens, efficiency, time per
stage). The input is read lazily and cut into chunks by position (`qvl.data.chunks`); each chunk is validated
and counted by whichever worker gets it, in this process, in `workers` processes or as Ray tasks, and its
results go to disk. The driver keeps five integers per accepted sample (source index, length, where the sample
is spilled), packs those, and hands shards out to the same workers. Memory is flat in the corpus size.

Preference records (`kind`, qvl.data.preference) go the same way: a pair of a chosen and a rejected conversation is
one item of the plan, so both sides land in one pack.

Everything is built in `OUT.partial/` under a fingerprint of the input and settings: a run killed at any point
leaves nothing loadable, and the same command again reuses every finished chunk and shard. The output does not
depend on how many workers made it. Progress goes through an optional `Progress` hook (the CLI draws bars with
rates and ETAs); this module only logs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from qvl.data import chunks, parallel, write
from qvl.data.balance import check_global_batch, imbalance, plan_dp_balanced, plan_round_robin, reorder, schedule_order
from qvl.data.ingest import iter_record_texts
from qvl.data.pack import PackPlan, balance_by_cost, pack_best_fit_decreasing
from qvl.data.parallel import RayConfig
from qvl.data.preference import pair_pack_row, resolve_kind
from qvl.data.vision import check_family
from qvl.foundation.cost import lm_flops_per_sequence, shapes_from_hf_config, vision_flops_per_image
from qvl.foundation.errors import DataError

logger = logging.getLogger(__name__)

# stage(name, total) -> context manager yielding advance(n); the CLI passes rich bars, the default does nothing.
Progress = Callable[[str, int | None], contextlib.AbstractContextManager[Callable[[int], None]]]
# Settings that decide how the work is spread, not what it produces: left out of the fingerprint.
_NOT_IN_FINGERPRINT = ("output", "workers", "ray")


@contextlib.contextmanager
def _no_progress(name: str, total: int | None) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """Everything `qvl data prepare` needs; the required fields have no defaults."""

    input: pathlib.Path
    media_root: pathlib.Path
    family: str
    hf_path: pathlib.Path  # HF dir with the tokenizer, chat template and processor configs
    seq_length: int
    output: pathlib.Path
    kind: str = "auto"  # "sft", "preference" (pairs, qvl.data.preference) or "auto": the first parseable record's
    system_prompt: str | None = None
    chat_template: pathlib.Path | None = None
    # The chat template's switches as `apply_chat_template` takes them (enable_thinking=False, reasoning_effort="low")
    template_args: dict[str, Any] = field(default_factory=dict)
    reasoning_loss: bool = True  # learn assistant reasoning blocks (<think>...</think>) with their answers
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    truncate: bool = False
    balance_cost: bool = False  # even out packs' forward FLOPs (qvl.foundation.cost) at equal token fill
    data_parallel: int | None = None  # with global_batch_size: schedule packs into (step, rank) by compute cost
    global_batch_size: int | None = None  # packs per optimizer step over all data-parallel ranks
    model_config: pathlib.Path | None = None  # HF config.json (or its dir) for the cost model; default: hf_path
    seed: int = 0  # the DP schedule's step order
    decode_images: bool = True  # check every image is intact; False reads headers only
    full_decode: bool = False  # decode every pixel instead of the structure / CRC check (qvl.data.integrity)
    packs_per_shard: int | None = None  # None: write.auto_packs_per_shard (256, fewer for small datasets)
    count_batch_size: int = 256
    chunk_size: int = 1024  # records per unit of parallel work (and of resumption)
    workers: int | None = 1  # local worker processes; None: every core; 1: this process only
    ray: RayConfig | None = None  # run the chunks and shards as Ray tasks instead


@dataclass(kw_only=True, slots=True)
class _Samples:
    """What the driver holds per accepted sample, in chunk order: five integers."""

    index: np.ndarray  # source index in the input
    length: np.ndarray  # tokens
    chunk: np.ndarray  # where the sample is spilled: chunk number, byte offset and size in chunk-<k>.bin
    offset: np.ndarray
    size: np.ndarray
    first_length: np.ndarray  # a pair's chosen side's tokens (an SFT sample's: all of them)
    vision_flops: np.ndarray | None = None  # per sample, when a cost model is asked for
    vision_rows: np.ndarray | None = None  # per sample [n, 2]: the tower's image and video rows (None: not known)


@dataclass(kw_only=True, slots=True)
class _State:
    timings: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=lambda: {"ingest": 0.0, "validate": 0.0, "count": 0.0})
    reasons: collections.Counter = field(default_factory=collections.Counter)
    read: int = 0
    truncated: int = 0
    workers: str = ""
    reused: dict[str, int] = field(default_factory=lambda: {"chunks": 0, "shards": 0})  # finished by an earlier run
    media: int = 0  # images and videos in accepted samples
    vision_patches: int = 0  # their patches (t x h x w of every grid): what the planner's workload reads


def prepare(config: PrepareConfig, progress: Progress = _no_progress) -> dict:
    """Run the whole pipeline and return the report (also written to OUT/report.json)."""
    check_family(config.family)
    _check_dp(config)
    if config.seq_length < 16:
        raise DataError(f"--seq-length {config.seq_length} is too small; use at least 16 (typically 4096-32768)")
    _check_output(pathlib.Path(config.output))
    config = dataclasses.replace(config, kind=resolve_kind(config.input, config.kind))
    if config.kind == "preference" and config.truncate:
        raise DataError(
            "--truncate does not apply to preference pairs (a cut answer is not the answer that was ranked); drop it: "
            "a pair longer than --seq-length is quarantined as pair_too_long"
        )
    settings = _chunk_settings(config, write.partial_dir(config.output))
    # The tokenizer and processor settings, loaded once (a bad --hf-path fails here, before any work); forked
    # workers start with them, and one process uses them directly.
    counter = chunks.warm_up(settings).counter
    work = write.start_partial(config.output, _fingerprint(config))
    state = _State()
    total = count_records(config.input)
    workers = config.workers
    if total is not None and workers != 1:  # more processes than chunks would only cost their start-up
        workers = max(1, min(workers or len(os.sched_getaffinity(0)), -(-total // config.chunk_size)))
    with parallel.worker_pool(workers, config.ray) as pool:
        state.workers = pool.name
        n_chunks = _timed(state, "validate_count", lambda: _process(config, settings, pool, state, total, progress))
        samples = _merge(config, work, n_chunks, state)
        plan = _timed(state, "pack", lambda: _pack(samples, config))
        dp_report = None
        if config.data_parallel is not None:
            plan, dp_report = _timed(state, "schedule", lambda: _schedule(samples, plan, config))
        config = dataclasses.replace(
            config, packs_per_shard=config.packs_per_shard or write.auto_packs_per_shard(plan.n_packs)
        )
        report = _report(config, state, samples.length, plan)
        if dp_report:
            report["dp_plan"] = dp_report
        if not len(samples.length):
            _write_rejections_only(config, work, report)
        _write(config, work, pool, counter.pad_ids, plan, samples, state, report, progress)
    return report


def _chunk_settings(config: PrepareConfig, work: pathlib.Path) -> chunks.ChunkConfig:
    overrides = {
        "min_pixels": config.min_pixels,
        "max_pixels": config.max_pixels,
        "video_min_pixels": config.video_min_pixels,
        "video_max_pixels": config.video_max_pixels,
    }
    return chunks.ChunkConfig(
        work=pathlib.Path(work).resolve(),
        media_root=pathlib.Path(config.media_root).resolve(),
        family=config.family,
        tokenizer=pathlib.Path(config.hf_path).resolve(),
        seq_length=config.seq_length,
        kind=config.kind,
        chat_template=config.chat_template.read_text() if config.chat_template else None,
        template_args=tuple(sorted(config.template_args.items())),
        reasoning_loss=config.reasoning_loss,
        system_prompt=config.system_prompt,
        vision_overrides=tuple(sorted(overrides.items())),
        truncate=config.truncate,
        decode_images=config.decode_images,
        full_decode=config.full_decode,
        count_batch_size=config.count_batch_size,
    )


def _check_output(output: pathlib.Path) -> None:
    # The finished build replaces OUT wholesale, so never replace a directory that is not ours.
    if output.exists() and any(output.iterdir()) and not (output / "report.json").is_file():
        raise DataError(f"--output {output} exists and is not a qvl dataset; choose a new directory or remove it")


def _timed(state: _State, stage: str, fn):
    start = time.perf_counter()
    result = fn()
    state.timings[stage] = round(time.perf_counter() - start, 4)
    logger.info("%s: %.2fs", stage, state.timings[stage])
    return result


def count_records(path: pathlib.Path) -> int | None:
    """Records in a JSONL file (non-blank lines), for progress totals; None for a JSON array."""
    with open(path, "rb") as f:
        if f.read(1 << 16).lstrip()[:1] == b"[":
            return None
        f.seek(0)
        return sum(1 for line in f if line.strip())


def _process(config: PrepareConfig, settings, pool: parallel.WorkerPool, state: _State, total, progress) -> int:
    """Validate and count every chunk not already on disk; return the number of chunks."""
    n_chunks = 0

    def jobs() -> Iterator[tuple]:
        nonlocal n_chunks
        batch: list[str] = []
        for index, text in iter_record_texts(config.input):
            batch.append(text)
            if len(batch) == config.chunk_size:
                yield from _job(n_chunks, index + 1 - len(batch), batch)
                n_chunks, batch = n_chunks + 1, []
        if batch:
            yield from _job(n_chunks, n_chunks * config.chunk_size, batch)
            n_chunks += 1

    def _job(chunk: int, first: int, batch: list[str]) -> Iterator[tuple]:
        if chunks.is_done(settings.work, chunk):
            state.reused["chunks"] += 1
            advance(len(batch))
        else:
            yield settings, chunk, first, batch

    def on_result(result: dict) -> None:
        for stage, seconds in result["times"].items():
            state.cpu[stage] += seconds
        advance(result["read"])

    with progress("validate+count", total) as advance:
        pool.map(chunks.process_chunk, jobs(), on_result)
    return n_chunks


def _merge(config: PrepareConfig, work: pathlib.Path, n_chunks: int, state: _State) -> _Samples:
    """Read the chunks' summaries in order: per-sample integers, quarantine.jsonl, counters, vision cost."""
    columns = collections.defaultdict(list)
    vision_rows = []  # per chunk: its samples' image and video rows (None for a chunk spilled by an older qvl)
    shapes = _cost_shapes(config) if config.balance_cost or config.data_parallel is not None else None
    with (work / "quarantine.jsonl").open("w") as quarantine:
        for chunk in range(n_chunks):
            summary = chunks.load_summary(work, chunk)
            meta = summary["meta"]
            state.read += meta["read"]
            state.truncated += meta["truncated"]
            for row in meta["rejections"]:
                state.reasons[row["reason"]] += 1
                quarantine.write(json.dumps(row, ensure_ascii=False) + "\n")
            for key in ("index", "length", "offset", "size", "first_length"):
                columns[key].append(summary[key])
            state.media += len(summary["grid_thw"])
            state.vision_patches += int(summary["grid_thw"].prod(axis=1).sum()) if len(summary["grid_thw"]) else 0
            columns["chunk"].append(np.full(len(summary["index"]), chunk, dtype=np.int64))
            vision_rows.append(_vision_rows(summary))
            if shapes is not None:
                columns["vision_flops"].append(_vision_flops(shapes[1], summary))
    arrays = {key: np.concatenate(columns[key]) if columns[key] else np.zeros(0, np.int64) for key in columns}
    empty = np.zeros(0, np.int64)
    return _Samples(
        index=arrays.get("index", empty),
        length=arrays.get("length", empty),
        chunk=arrays.get("chunk", empty),
        offset=arrays.get("offset", empty),
        size=arrays.get("size", empty),
        first_length=arrays.get("first_length", empty),
        vision_flops=arrays.get("vision_flops", np.zeros(0)) if shapes is not None else None,
        vision_rows=np.concatenate(vision_rows) if vision_rows and all(r is not None for r in vision_rows) else None,
    )


def _vision_rows(summary: dict) -> np.ndarray | None:
    """Per sample of a chunk, [image rows, video rows]: the patches (t x h x w) the vision tower encodes for it (a
    pair's shared media once); None for a chunk spilled without media kinds."""
    if "grid_video" not in summary:
        return None
    n, grids = len(summary["index"]), summary["grid_thw"]
    rows = np.zeros((n, 2), dtype=np.int64)
    if len(grids):
        np.add.at(rows, (summary["grid_owner"], summary["grid_video"].astype(np.int64)), grids.prod(axis=1))
    return rows


def _cost_shapes(config: PrepareConfig):
    return shapes_from_hf_config(pathlib.Path(config.model_config or config.hf_path))


def _vision_flops(vision_shape, summary: dict) -> np.ndarray:
    n = len(summary["index"])
    if not len(summary["grid_thw"]):
        return np.zeros(n)
    per_image = vision_flops_per_image(vision_shape, summary["grid_thw"])
    return np.bincount(summary["grid_owner"], weights=per_image, minlength=n)


def sample_costs(config: PrepareConfig, samples: _Samples) -> np.ndarray:
    """Forward FLOPs per accepted sample (a pair: both sides): the LM over each sub-sequence's tokens plus the vision
    tower over its images (a pair's once)."""
    lm, _ = _cost_shapes(config)
    first, rest = samples.first_length, samples.length - samples.first_length  # rest: 0 for an SFT sample
    return lm_flops_per_sequence(lm, first) + lm_flops_per_sequence(lm, rest) + samples.vision_flops


def _pack(samples: _Samples, config: PrepareConfig) -> PackPlan:
    plan = pack_best_fit_decreasing(samples.length, config.seq_length)
    if config.balance_cost:
        plan = balance_by_cost(plan, samples.length, sample_costs(config, samples))
    return plan


def _check_dp(config: PrepareConfig) -> None:
    if (config.data_parallel is None) != (config.global_batch_size is None):
        raise DataError("--data-parallel and --global-batch-size go together; pass both (or neither)")
    if config.data_parallel is not None:
        check_global_batch(0, config.data_parallel, config.global_batch_size)
    if config.data_parallel is not None or config.balance_cost:
        path = pathlib.Path(config.model_config or config.hf_path)
        if not (path / "config.json" if path.is_dir() else path).is_file():
            flag = "--balance-cost" if config.data_parallel is None else "the DP plan"
            raise DataError(
                f"{flag}'s cost model needs the model's config.json; none at {path}: pass "
                "--model-config PATH (the HF checkpoint dir or its config.json)"
            )


def _schedule(samples: _Samples, plan: PackPlan, config: PrepareConfig) -> tuple[PackPlan, dict]:
    """The packs in (step, rank, slot) order with "cost", "step", "rank" and "slot" columns, and the plan's report."""
    costs = sample_costs(config, samples)
    pack_cost = np.bincount(
        np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets)), weights=costs[plan.order], minlength=plan.n_packs
    )
    dp = plan_dp_balanced(pack_cost, config.data_parallel, config.global_batch_size, seed=config.seed)
    naive = imbalance(plan_round_robin(plan.n_packs, config.data_parallel, config.global_batch_size), pack_cost)
    order = schedule_order(dp)
    dp = reorder(dp, order)
    plan = plan.reordered(order)
    plan.columns.update(cost=pack_cost[order], step=dp.step, rank=dp.rank, slot=dp.slot)
    report = {
        "data_parallel": config.data_parallel,
        "global_batch_size": config.global_batch_size,
        "packs_per_rank_per_step": config.global_batch_size // config.data_parallel,
        "steps": dp.n_steps,
        "unscheduled_packs": int((dp.step < 0).sum()),
        "cost_unit": "forward FLOPs",
        "qvl": imbalance(dp, plan.columns["cost"]),
        "round_robin": naive,
    }
    logger.info(
        "DP plan: max/mean rank cost %.4f (round-robin %.4f)",
        report["qvl"]["mean_max_over_mean"],
        naive["mean_max_over_mean"],
    )
    return plan, report


def _report(config: PrepareConfig, state: _State, lengths: np.ndarray, plan: PackPlan) -> dict:
    return {
        "family": config.family,
        "seq_length": config.seq_length,
        "kind": config.kind,
        **({"pairs": int(len(lengths))} if config.kind == "preference" else {}),  # accepted pairs
        "template_args": dict(sorted(config.template_args.items())),
        "reasoning_loss": config.reasoning_loss,
        "read": state.read,
        "accepted": int(len(lengths)),
        "quarantined": sum(state.reasons.values()),
        "quarantined_by_reason": dict(sorted(state.reasons.items())),
        "truncated": state.truncated,
        "total_tokens": int(lengths.sum()),
        "media": state.media,
        "vision_patches": state.vision_patches,
        "packed_sequences": plan.n_packs,
        "packing_efficiency": round(plan.efficiency(lengths), 6),
        "packs_per_shard": config.packs_per_shard,
        "workers": state.workers,
        "time_s": state.timings,  # wall time per driver stage, filled in as stages finish
        "worker_cpu_s": {k: round(v, 4) for k, v in state.cpu.items()},  # summed over workers (this run's chunks)
        "reused": state.reused,  # chunks and shards an earlier, interrupted run of the same command finished
    }


def _shard_jobs(work: pathlib.Path, plan: PackPlan, samples: _Samples, config: write.WriteConfig) -> Iterator[tuple]:
    for shard, packs in enumerate(write.shard_packs(plan.n_packs, config.packs_per_shard)):
        if (work / write.shard_name(shard)).is_file():
            continue
        where = [
            (k, list(zip(*(samples.chunk[i].tolist(), samples.offset[i].tolist(), samples.size[i].tolist()))))
            for k in packs
            for i in [plan.pack(k)]
        ]
        yield work, shard, where, config


def _write(config, work, pool, pad_ids, plan: PackPlan, samples: _Samples, state: _State, report: dict, progress):
    start = time.perf_counter()
    write_config = write.WriteConfig(
        output=config.output,
        family=config.family,
        pad_ids=pad_ids,
        packs_per_shard=config.packs_per_shard,
        pairs=config.kind == "preference",
    )
    shards = write.shard_packs(plan.n_packs, config.packs_per_shard)
    shard_names = [write.shard_name(s) for s in range(len(shards))]
    with progress("write", plan.n_packs) as advance:
        done = [len(packs) for name, packs in zip(shard_names, shards) if (work / name).is_file()]
        state.reused["shards"] = len(done)
        advance(sum(done))
        pool.map(write.write_shard_from_spill, _shard_jobs(work, plan, samples, write_config), advance)
    # Energon reads every shard back to index it: in as many processes of its own as this run has workers (one
    # for a one-process run), at most this machine's cores.
    cores = len(os.sched_getaffinity(0))
    write.write_energon_meta(work, shard_names, workers=max(1, min(cores, pool.workers, len(shard_names))))
    _write_jsonl(work / "packs.jsonl", _pack_rows(plan, samples, config.packs_per_shard, config.kind))
    report["shards"] = len(shard_names)
    state.timings["write"] = round(time.perf_counter() - start, 4)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(work / chunks.CHUNK_DIR)  # spilled tokens: every shard that needs them is written
    write.commit(work, config.output)


def _write_rejections_only(config: PrepareConfig, work: pathlib.Path, report: dict) -> None:
    """Nothing to pack: leave the quarantine and report (no shards, no .nv-meta) and fail."""
    output = pathlib.Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "quarantine.jsonl", output / "quarantine.jsonl")
    (output / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(work)
    raise DataError(f"no sample of {config.input} was accepted; the reasons are in {output / 'quarantine.jsonl'}")


def _pack_rows(plan: PackPlan, samples: _Samples, packs_per_shard: int, kind: str) -> Iterator[dict]:
    for k in range(plan.n_packs):
        items = plan.pack(k)
        row = {"pack": k, "shard": write.shard_name(write.shard_of_pack(k, packs_per_shard))}
        if kind == "preference":
            row.update(pair_pack_row(items, samples.index, samples.length, samples.first_length))
        else:
            row.update(samples=samples.index[items].tolist(), lengths=samples.length[items].tolist())
        if samples.vision_rows is not None:  # the tower's calls, which plan its CUDA graphs' sizes
            row["vision_rows"] = samples.vision_rows[items].sum(axis=0).tolist()
        row.update({name: column[k].item() for name, column in plan.columns.items()})
        yield row


def _write_jsonl(path: pathlib.Path, rows) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _fingerprint(config: PrepareConfig) -> str:
    """Identifies the chunks and shards: same input, tokenizer dir and settings -> same files, however many workers."""
    digest = hashlib.sha256()
    settings = {k: str(v) for k, v in asdict(config).items() if k not in _NOT_IN_FINGERPRINT}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    digest.update(_file_digest(config.input))
    for path in sorted(pathlib.Path(config.hf_path).glob("*.json")) + sorted(
        pathlib.Path(config.hf_path).glob("*.jinja")
    ):
        digest.update(path.name.encode() + _file_digest(path))
    if config.chat_template:
        digest.update(_file_digest(config.chat_template))
    return digest.hexdigest()


def _file_digest(path: pathlib.Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()
