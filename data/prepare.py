"""Prepare: ingest -> validate -> count -> pack -> write, with quarantine, packs and report files.

`prepare(config)` builds the Energon dataset in `config.output` plus `quarantine.jsonl` (one line per rejected
sample), `packs.jsonl` (one line per packed sequence) and `report.json` (counts, tokens, efficiency, time per
stage). Progress goes through an optional `Progress` hook so the CLI can draw bars; this module only logs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from qvl.data import write
from qvl.data.count import TokenCounter, TokenizedSample, load_tokenizer, truncate
from qvl.data.ingest import Conversation, IngestConfig, Rejection, read_records, to_conversation
from qvl.data.pack import PackPlan, attention_cost, balance_by_cost, pack_best_fit_decreasing
from qvl.data.validate import ValidateConfig, ValidSample, validate_sample
from qvl.data.vision import check_family, load_vision_config

logger = logging.getLogger(__name__)

# stage(name, total) -> context manager yielding advance(n); the CLI passes rich bars, the default does nothing.
Progress = Callable[[str, int | None], contextlib.AbstractContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def _no_progress(name: str, total: int | None) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """Everything `qvl data prepare` needs; the required fields have no defaults."""

    input: pathlib.Path
    media_root: pathlib.Path
    family: str
    tokenizer: pathlib.Path  # HF dir with the tokenizer, chat template and processor configs
    seq_length: int
    output: pathlib.Path
    system_prompt: str | None = None
    chat_template: pathlib.Path | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    truncate: bool = False
    balance_cost: bool = False
    data_parallel: int | None = None  # with global_batch: schedule packs into (step, rank) by compute cost
    global_batch: int | None = None  # packs per optimizer step over all data-parallel ranks
    model_config: pathlib.Path | None = None  # HF config.json (or its dir) for the cost model; default: tokenizer dir
    seed: int = 0  # the DP schedule's step order
    decode_images: bool = True
    packs_per_shard: int = 256
    count_batch_size: int = 256


@dataclass(kw_only=True, slots=True)
class _State:
    rejections: list[Rejection] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    read: int = 0
    truncated: int = 0


def prepare(config: PrepareConfig, progress: Progress = _no_progress) -> dict:
    """Run the whole pipeline and return the report (also written to OUT/report.json)."""
    check_family(config.family)
    _check_dp(config)
    if config.seq_length < 16:
        raise ValueError(f"--seq-length {config.seq_length} is too small; use at least 16 (typically 4096-32768)")
    _check_output(pathlib.Path(config.output))
    state = _State()
    vision = load_vision_config(
        config.tokenizer,
        config.family,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        video_min_pixels=config.video_min_pixels,
        video_max_pixels=config.video_max_pixels,
    )
    template = config.chat_template.read_text() if config.chat_template else None
    counter = TokenCounter(tokenizer=load_tokenizer(config.tokenizer, template), vision=vision)

    conversations = _timed(state, "ingest", lambda: _ingest(config, state, progress))
    valid = _timed(state, "validate", lambda: _validate(conversations, config, vision, state, progress))
    samples = _timed(state, "count", lambda: _count(valid, counter, config, state, progress))
    lengths = np.asarray([s.length for s in samples], dtype=np.int64)
    plan = _timed(state, "pack", lambda: _pack(samples, lengths, config))
    dp_report = None
    if config.data_parallel is not None:
        plan, dp_report = _timed(state, "schedule", lambda: _schedule(samples, lengths, plan, config))
    report = _report(config, state, lengths, plan)
    if dp_report:
        report["dp_plan"] = dp_report
    if not samples:
        _write_rejections_only(config, state, report)
    _write(config, counter, plan, samples, lengths, state, report, progress)
    return report


def _check_output(output: pathlib.Path) -> None:
    # The finished build replaces OUT wholesale, so never replace a directory that is not ours.
    if output.exists() and any(output.iterdir()) and not (output / "report.json").is_file():
        raise ValueError(f"--output {output} exists and is not a qvl dataset; choose a new directory or remove it")


def _timed(state: _State, stage: str, fn):
    start = time.perf_counter()
    result = fn()
    state.timings[stage] = round(time.perf_counter() - start, 4)
    logger.info("%s: %.2fs", stage, state.timings[stage])
    return result


def _ingest(config: PrepareConfig, state: _State, progress: Progress) -> list[Conversation]:
    ingest_config = IngestConfig(system_prompt=config.system_prompt)
    conversations = []
    with progress("ingest", None) as advance:
        for index, record in read_records(config.input):
            state.read += 1
            item = record if isinstance(record, Rejection) else to_conversation(index, record, ingest_config)
            (state.rejections if isinstance(item, Rejection) else conversations).append(item)
            advance(1)
    return conversations


def _validate(conversations, config, vision, state: _State, progress: Progress) -> list[ValidSample]:
    validate_config = ValidateConfig(media_root=config.media_root, vision=vision, decode_images=config.decode_images)
    valid = []
    with progress("validate", len(conversations)) as advance:
        for conversation in conversations:
            item = validate_sample(conversation, validate_config)
            (state.rejections if isinstance(item, Rejection) else valid).append(item)
            advance(1)
    return valid


def _count(valid: list[ValidSample], counter: TokenCounter, config, state: _State, progress) -> list[TokenizedSample]:
    kept = []
    with progress("count", len(valid)) as advance:
        for start in range(0, len(valid), config.count_batch_size):
            batch = valid[start : start + config.count_batch_size]
            for sample in counter.count(batch):
                kept_sample = _fit(sample, counter, config, state)
                if kept_sample is not None:
                    kept.append(kept_sample)
            advance(len(batch))
    return kept


def _fit(
    sample: TokenizedSample, counter: TokenCounter, config: PrepareConfig, state: _State
) -> TokenizedSample | None:
    if sample.length <= config.seq_length:
        return sample
    if config.truncate:
        cut = truncate(sample, config.seq_length, counter.pad_ids)
        if cut is not None:
            state.truncated += 1
            return cut
    detail = f"{sample.length} tokens > seq_length {config.seq_length}"
    state.rejections.append(Rejection(index=sample.index, reason="too_long", detail=detail))
    return None


def _pack(samples: list[TokenizedSample], lengths: np.ndarray, config: PrepareConfig) -> PackPlan:
    plan = pack_best_fit_decreasing(lengths, config.seq_length)
    if config.balance_cost:
        patches = [np.asarray([g[0] * g[1] * g[2] for g in s.image_grids + s.video_grids]) for s in samples]
        plan = balance_by_cost(plan, lengths, attention_cost(lengths, patches))
    return plan


def _check_dp(config: PrepareConfig) -> None:
    if (config.data_parallel is None) != (config.global_batch is None):
        raise ValueError("--data-parallel and --global-batch go together; pass both (or neither)")
    if config.data_parallel is not None:
        from qvl.data.balance import check_global_batch

        check_global_batch(0, config.data_parallel, config.global_batch)
        path = pathlib.Path(config.model_config or config.tokenizer)
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise ValueError(
                f"the DP plan's cost model needs the model's config.json; none at {path}: pass "
                "--model-config PATH (the HF checkpoint dir or its config.json)"
            )


def _schedule(samples, lengths: np.ndarray, plan: PackPlan, config: PrepareConfig) -> tuple[PackPlan, dict]:
    """The packs in (step, rank, slot) order with "cost", "step", "rank" and "slot" columns, and the plan's report."""
    from qvl.data.balance import imbalance, plan_dp_balanced, plan_round_robin, reorder, schedule_order
    from qvl.data.cost import sample_flops, shapes_from_hf_config

    lm, vision = shapes_from_hf_config(pathlib.Path(config.model_config or config.tokenizer))
    grids = [g for s in samples for g in list(s.image_grids) + list(s.video_grids)]
    owners = np.repeat(np.arange(len(samples)), [len(s.image_grids) + len(s.video_grids) for s in samples])
    costs = sample_flops(lm, vision, lengths, np.asarray(grids, np.int64).reshape(-1, 3), owners)
    pack_cost = np.bincount(
        np.repeat(np.arange(plan.n_packs), np.diff(plan.offsets)), weights=costs[plan.order], minlength=plan.n_packs
    )
    dp = plan_dp_balanced(pack_cost, config.data_parallel, config.global_batch, seed=config.seed)
    naive = imbalance(plan_round_robin(plan.n_packs, config.data_parallel, config.global_batch), pack_cost)
    order = schedule_order(dp)
    dp = reorder(dp, order)
    plan = plan.reordered(order)
    plan.columns.update(cost=pack_cost[order], step=dp.step, rank=dp.rank, slot=dp.slot)
    report = {
        "data_parallel": config.data_parallel,
        "global_batch": config.global_batch,
        "packs_per_rank_per_step": config.global_batch // config.data_parallel,
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
    reasons = collections.Counter(r.reason for r in state.rejections)
    return {
        "family": config.family,
        "seq_length": config.seq_length,
        "read": state.read,
        "accepted": int(len(lengths)),
        "quarantined": len(state.rejections),
        "quarantined_by_reason": dict(sorted(reasons.items())),
        "truncated": state.truncated,
        "total_tokens": int(lengths.sum()),
        "packed_sequences": plan.n_packs,
        "packing_efficiency": round(plan.efficiency(lengths), 6),
        "time_s": state.timings,  # filled in as stages finish
    }


def _write(config, counter, plan, samples, lengths, state: _State, report: dict, progress: Progress) -> None:
    start = time.perf_counter()
    work = write.start_partial(config.output, _fingerprint(config, plan, lengths))
    write_config = write.WriteConfig(
        output=config.output, family=config.family, pad_ids=counter.pad_ids, packs_per_shard=config.packs_per_shard
    )
    with progress("write", plan.n_packs) as advance:
        shard_names = write.write_shards(work, plan, samples, write_config, on_pack=advance)
    write.write_energon_meta(work, shard_names)
    _write_jsonl(work / "quarantine.jsonl", (r.to_json() for r in sorted(state.rejections, key=lambda r: r.index)))
    _write_jsonl(work / "packs.jsonl", _pack_rows(plan, samples, lengths, config.packs_per_shard))
    report["shards"] = len(shard_names)
    state.timings["write"] = round(time.perf_counter() - start, 4)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    write.commit(work, config.output)


def _write_rejections_only(config: PrepareConfig, state: _State, report: dict) -> None:
    """Nothing to pack: leave the quarantine and report (no shards, no .nv-meta) and fail."""
    output = pathlib.Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    _write_jsonl(output / "quarantine.jsonl", (r.to_json() for r in sorted(state.rejections, key=lambda r: r.index)))
    (output / "report.json").write_text(json.dumps(report, indent=2))
    raise ValueError(f"no sample of {config.input} was accepted; the reasons are in {output / 'quarantine.jsonl'}")


def _pack_rows(plan: PackPlan, samples, lengths: np.ndarray, packs_per_shard: int) -> Iterator[dict]:
    indices = np.asarray([s.index for s in samples], dtype=np.int64)
    for k in range(plan.n_packs):
        items = plan.pack(k)
        row = {
            "pack": k,
            "shard": write.shard_name(write.shard_of_pack(k, packs_per_shard)),
            "samples": indices[items].tolist(),
            "lengths": lengths[items].tolist(),
        }
        row.update({name: column[k].item() for name, column in plan.columns.items()})
        yield row


def _write_jsonl(path: pathlib.Path, rows) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _fingerprint(config: PrepareConfig, plan: PackPlan, lengths: np.ndarray) -> str:
    """Identifies the shard contents: same input, tokenizer dir, settings and plan -> same shards."""
    digest = hashlib.sha256()
    settings = {k: str(v) for k, v in asdict(config).items() if k != "output"}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    digest.update(_file_digest(config.input))
    for path in sorted(pathlib.Path(config.tokenizer).glob("*.json")) + sorted(
        pathlib.Path(config.tokenizer).glob("*.jinja")
    ):
        digest.update(path.name.encode() + _file_digest(path))
    for array in (plan.order, plan.offsets, lengths):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _file_digest(path: pathlib.Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()
