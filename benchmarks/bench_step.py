"""The step census: one training step of a recipe at real shapes, counted on CPU as a CUDA device runs it.

`python -m benchmarks.bench_step [--config NAME ...] [--quick] [--out .bench]` (part of `make bench`).

Each config trains two steps of its pretrain recipe through Megatron-Bridge's own `pretrain()` on the CPU, with the
model's real layer counts, tiny widths (`scaled_hf_config`) and packs of the real length and image sizes (LLaVA-like:
780-token samples, 62% image tokens, 1,936-patch images, 5 per 4k pack). The second step is recorded op by op
(benchmarks.step_census) and reported per step and per region (LM, vision tower, loss, optimizer, other):
kernel-launching ops, view ops, host syncs with call sites, GEMM FLOPs at the real widths and the share whose row
pitches are not 16-byte multiples, non-GEMM bytes per pack, host-to-device copies and the optimizer's largest
temporary. A small step-time model, calibrated on the H100 run of benchmarks/RESULTS.md, turns the counts into an
ESTIMATE of the step time, printed next to the 4.55 s measured there; it is a model, not a measurement.

Each config runs in its own process (Megatron's global state stays out of this one).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import pathlib
import sys
from dataclasses import asdict, dataclass, replace
from unittest import mock

import torch

from benchmarks import step_calibration, step_plot
from benchmarks.step_model import (
    BEFORE_CENSUS,
    StepTimeModel,
    goal_checks,
    graphed_launches,
    profile_match,
    second_profile_checks,
    table,
)
from benchmarks.step_regions import Regions, census_forward_step, marked, tower_bucket_rows
from benchmarks.step_shapes import (
    CONFIGS,
    DEFAULT_CONFIGS,
    MEASURED_CONFIG,
    RESULTS_CONFIG,
    StepConfig,
    graphs_estimated,
    scaled_hf_config,
    synthetic_batches,
    write_model_dir,
)

logger = logging.getLogger(__name__)


# --- the training child ---------------------------------------------------------------------------------------------


def census_dataset_class():
    """A dataset config whose loader yields `synthetic_batches` (built on demand: it imports Megatron-Bridge)."""
    from megatron.bridge.training.config import DatasetProvider

    from qvl.recipes.base import QvlPackedDatasetConfig

    @dataclass(kw_only=True)
    class CensusDatasetConfig(QvlPackedDatasetConfig):
        batches: object = None  # an iterator of PackedBatch

        def finalize(self) -> None:
            DatasetProvider.finalize(self)  # no dataset folder to check: the packs are synthetic

        def build_datasets(self, context):
            return self.batches, None, None

    return CensusDatasetConfig


def tower_launches(cfg) -> int | None:
    """What one graphed call of `cfg`'s vision tower launches (qvl.kernels.tower_graphs): the HF tower's one output,
    or Megatron-Bridge's Qwen3-VL tower's embeddings and deepstack features; None without a tower."""
    from qvl.kernels import switch
    from qvl.kernels.tower_graphs import launches_per_call

    vision = getattr(cfg.model, "vision_config", None)
    if vision is None:
        return None
    if not switch.Target.of(cfg, device="cuda").hf_vision_tower:
        deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        return launches_per_call(windowed=False, outputs=1 + deepstack, megatron=True)
    return launches_per_call(windowed=getattr(vision, "window_size", None) is not None)


def _host_indices(model: list, census) -> None:
    """Mark the host tensors the model made before the census followed placement: Megatron-Core's all-to-all token
    dispatcher keeps its chunk-sort indices on the host (`permute_idx_device`, "cpu" without the fused permute)."""
    for chunk in model:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if getattr(dispatcher, "permute_idx_device", None) == "cpu":
                census.mark_host([dispatcher.sort_input_by_local_experts, dispatcher.restore_output_by_local_experts])


@contextlib.contextmanager
def balanced_routing(census):
    """A MoE router's choices made even: token t's top-k experts are (t k + j) mod E for j < k, by a fixed bias on its
    logits (added outside the count: a stand-in, not the step's work). Each of E local experts then gets T k / E rows,
    as a trained router's balancing loss aims for, the same in every run; and no expert's row count can equal a tiny
    width (a random router's could, and the census would read those rows as that width's real one)."""
    from megatron.core.transformer.moe.router import TopKRouter

    gating = TopKRouter.gating

    def balanced_gating(self, input):
        logits = gating(self, input)
        experts, k = logits.shape[-1], self.config.moe_router_topk
        tokens = logits.numel() // experts
        with census.paused():
            chosen = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts
            bias = torch.zeros(tokens, experts, dtype=logits.dtype).scatter_(1, chosen, 100.0)
            return logits + bias.view(logits.shape)

    with mock.patch.object(TopKRouter, "gating", balanced_gating):
        yield


def _numels(model: list, widths) -> None:
    """Real numels of each parameter's and each flat buffer's tiny numel (the distributed optimizer's shards and the
    gradient buffers are flat)."""
    for chunk in model:
        for param in chunk.parameters():
            widths.numels.setdefault(param.numel(), math.prod(widths.shape(tuple(param.shape))))
        for buffer in getattr(chunk, "buffers", []) or []:
            params = list(getattr(buffer, "params", []))
            tiny = sum(p.numel() for p in params)
            real = sum(math.prod(widths.shape(tuple(p.shape))) for p in params)
            if not tiny:
                continue
            for flat in [buffer.grad_data, getattr(buffer, "param_data", None)] + [
                b.grad_data for b in getattr(buffer, "buckets", [])
            ]:
                if flat is not None:
                    widths.numels.setdefault(flat.numel(), round(flat.numel() * real / tiny))


@contextlib.contextmanager
def cuda_code_path(census):
    """What the CPU run swaps so that it takes a CUDA device's code path (see benchmarks.step_census)."""
    from benchmarks.step_kernels import VARLEN_NAMES, dispatcher_host_copies, fake_varlen_kernel, router_graph_waits
    from qvl.kernels import torch_wgrad_accum, varlen_attention

    def usable(query, *, dropout_p: float = 0.0, padded_layout: bool = False) -> bool:
        return varlen_attention.varlen_supported(device_type="cuda", dtype=query.dtype, head_dim=query.shape[-1],
                                          dropout_p=dropout_p, padded_layout=padded_layout)  # fmt: skip

    import torch.optim.optimizer as optimizer_module

    devices = optimizer_module._get_foreach_kernels_supported_devices
    rng_state = torch.get_rng_state

    def host_rng_state():  # a host tensor on every device (Megatron's RNG tracker compares it after each fork)
        state = rng_state()
        census.mark_host(state)
        return state

    with (
        mock.patch.object(torch, "get_rng_state", host_rng_state),
        mock.patch.object(varlen_attention, "varlen_usable", usable),
        mock.patch.object(varlen_attention, "_varlen_kernel", lambda: (fake_varlen_kernel(census), VARLEN_NAMES)),
        mock.patch.object(optimizer_module, "_get_foreach_kernels_supported_devices",
                          lambda: [*devices(), "cpu"]),
        torch_wgrad_accum.cpu_mixed_precision_addmm(),  # bf16 wgrad into fp32 main_grad: one GEMM (CUDA kernel only)
        dispatcher_host_copies(census),
        router_graph_waits(census),
    ):  # fmt: skip
        yield


@contextlib.contextmanager
def step_code(*, baseline: bool):
    """Before the config is built: the code as measured on the H100 (`baseline`, RESULTS.md: no aligned widths, no
    lean vision tower nor the loader's tower inputs, no host facts for the model's forwards, of qvl's groups only the
    torch-Adam resume fixes and the wheel's dataset helpers), or the copies a CUDA device gets (pinned, non-blocking:
    qvl.training.step.to_device). qvl's step then runs with the groups the switch decides for the config on a CUDA
    device (`census_worker`)."""
    from qvl.foundation import patches
    from qvl.kernels import fix_adam_resume

    if baseline:
        with (
            mock.patch("qvl.bridges.fixes.align_vision_widths", lambda provider: {}),
            mock.patch("qvl.kernels.speed_hf_vision.use_lean_vision", lambda provider: False),
            mock.patch("qvl.kernels.torch_wgrad_accum.use_fused_wgrad_accumulation", lambda provider: None),
            mock.patch("qvl.training.step.host_batch", lambda *args: None),  # the model's forwards as upstream's
            patches.applied(fix_adam_resume.GROUP, "fix-megatron-setup"),
        ):
            yield
        return
    with mock.patch("qvl.training.step.pinned_copies", lambda device: True):
        yield


@contextlib.contextmanager
def replays_counted(census, config: StepConfig):
    """CUDA graphs recorded on the CPU (qvl.foundation.graph_replay), each replay counted as the one launch a CUDA
    graph's replay is, the ops it runs again not counted: what the host launches in a graphed step. The graphs'
    fixed shapes are the config's (its packs have no dataset folder to plan them from)."""
    from qvl.foundation import graph_replay
    from qvl.kernels.speed_cuda_graphs import GraphShapes

    replay = graph_replay.RecordedGraph.replay
    shapes = GraphShapes(tokens=config.seq_length, slots=config.samples_per_pack + 1, max_seqlen=config.seq_length)

    def counted_replay(graph) -> None:
        census.graph_replay()
        with census.paused():
            replay(graph)

    with (
        graph_replay.recorded_graphs(),
        mock.patch.object(graph_replay.RecordedGraph, "replay", counted_replay),
        mock.patch("qvl.training.step.graph_shapes", lambda cfg: shapes),
    ):
        yield


def census_worker(spec_path: pathlib.Path) -> int:
    """Train two steps of the spec's config and write the census of the second (the training child)."""
    from benchmarks.compiled_regions import cuda_compiled_regions
    from benchmarks.op_costs import WidthMap
    from benchmarks.step_census import Census
    from benchmarks.step_linear_attention import fla_code_path
    from qvl.foundation import distributed, megatron, runtime
    from qvl.foundation.families import get_family
    from qvl.kernels import switch
    from qvl.training.loop import TrainRequest, prepare_config

    spec = json.loads(spec_path.read_text())
    config = StepConfig(**{**spec["config"], "image_grid": tuple(spec["config"]["image_grid"])})
    out = pathlib.Path(spec["out"])
    os.environ.setdefault("MASTER_PORT", str(distributed.free_port()))
    runtime.activate(force=True)
    runtime.enable_bridge_training()
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.utils import get_model_config

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)

    hf_dir, dims = write_model_dir(out / "hf", config)
    hf, _ = scaled_hf_config(config)
    census = Census(WidthMap(dims=dims))
    overrides = {"hf_path": str(hf_dir), "seq_length": config.seq_length, "global_batch_size": config.packs,
                 "micro_batch_size": 1, "train_iters": 2, "warmup_iters": 1, "save_interval": 10**6,
                 "log_interval": 10**6, "precision": "bf16-mixed", "vision_recompute": config.vision_recompute,
                 "tensor_parallel": 1}  # fmt: skip  # every census is one GPU's step
    if config.local_experts:  # one GPU's share of the experts (StepConfig.local_experts), on one rank
        overrides["expert_parallel"] = 1
    if config.grouped_experts:
        overrides["grouped_experts"] = True
    if spec.get("compile"):
        overrides["compile"] = True
    if spec.get("recorded_graphs"):
        overrides["cuda_graphs"] = True
    code = contextlib.ExitStack()  # the step's code, before or after: from the provider (aligned widths) on
    code.enter_context(step_code(baseline=spec["baseline"]))
    if not spec["baseline"] and not spec.get("eager_regions"):  # what CUDA runs compiled (benchmarks.compiled_regions)
        code.enter_context(cuda_compiled_regions(census))
    if get_family(config.family).moe:
        code.enter_context(balanced_routing(census))
    if spec.get("recorded_graphs"):  # the graphed step as it runs, its graphs recorded: each replay one launch
        code.enter_context(replays_counted(census, config))
    _, cfg = prepare_config(TrainRequest(recipe=config.recipe, overrides=overrides, run_dir=out / "run"))
    if megatron.gated_delta_net(cfg.model):  # fla's kernels, before the training groups wrap them
        code.enter_context(fla_code_path(census))
    # what a training loop on a CUDA device with fla applies (qvl.training.loop.run_megatron_loop; only Gated DeltaNet
    # models' groups ask for fla, whose kernels the census counts)
    target = replace(switch.Target.of(cfg, device="cuda"), fla=True)
    groups = () if spec["baseline"] else switch.training_groups(target)
    code.enter_context(switch.applied_for_training(target) if groups else contextlib.nullcontext())
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    dataset = cfg.dataset
    # made before training, as a loader's workers would: none of it is the step's work
    batches = list(itertools.islice(synthetic_batches(config, hf, tower_inputs=not spec["baseline"]), 2 * config.packs))
    cfg.dataset = census_dataset_class()(
        **{f: getattr(dataset, f) for f in ("hf_path", "family", "seq_length", "micro_batch_size")},
        path=None,
        num_workers=0,
        batches=marked(batches, census),
    )
    regions = Regions(census)
    stack = contextlib.ExitStack()
    losses = []

    def step_start(context):
        step = context.state.train_state.step + 1
        if step == 1:  # placement is followed from the first step (its optimizer state is made there)
            stack.enter_context(census.tracking())
            _host_indices(context.model, census)
        if step == 2:
            _numels(context.model, census.widths)
            if not spec.get("recorded_graphs"):  # Megatron-Core refuses a graphed layer's forward pre-hooks
                regions.install(context.model, get_model_config(context.model[0]))
            regions.set("other")
            stack.enter_context(census.counted())

    def step_end(context):
        if context.state.train_state.step + 1 == 2:
            stack.close()
        loss = (context.loss_dict or {}).get("lm loss")
        if loss is not None:
            losses.append(float(loss[0] / loss[1]) if isinstance(loss, (tuple, list)) else float(loss))

    callbacks = CallbackManager()
    callbacks.register("on_train_step_start", step_start)
    callbacks.register("on_train_step_end", step_end)
    with code, cuda_code_path(census):
        pretrain(cfg, census_forward_step(census, regions), callbacks=callbacks)
    result = {"config": asdict(config), "baseline": spec["baseline"], "compile": bool(spec.get("compile")),
              "training_groups": list(groups), "losses": losses}  # fmt: skip
    result |= census.summary(config.packs)
    census.graphed["tower_bucket_rows"] = tower_bucket_rows(regions)
    if graphs_estimated(config):
        result["cuda_graphs"] = graphed_launches(result, census.graphed, tower_launches_per_call=tower_launches(cfg),
                                                 moe_blocks=get_family(config.family).moe)  # fmt: skip
    pathlib.Path(spec["result"]).write_text(json.dumps(result, indent=1))
    return 0


# --- the driver -----------------------------------------------------------------------------------------------------


def census(config_name: str, out: pathlib.Path, *, baseline: bool = False, compile: bool = False,
           eager_regions: bool = False, recorded_graphs: bool = False) -> dict:  # fmt: skip
    """The census of one config (`compile`: the recipe's `compile=True`; `eager_regions`: compiled regions counted
    as their eager ops, as the CPU runs them), trained in a child process; raises with the child's log if it fails."""
    run_dir = out / f"step-{config_name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"config": asdict(CONFIGS[config_name]), "out": str(run_dir), "result": str(run_dir / "census.json"),
            "baseline": baseline, "compile": compile, "eager_regions": eager_regions,
            "recorded_graphs": recorded_graphs}  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec))
    (run_dir / "census.json").unlink(missing_ok=True)
    from qvl.foundation import distributed

    log = run_dir / "log.txt"
    log.unlink(missing_ok=True)
    try:  # forked from the server that has Megatron-Bridge imported already, as local ranks are
        distributed.start_ranks(_census_child, (str(run_dir / "spec.json"), str(log)), 1)
    except Exception as err:
        text = log.read_text(errors="replace") if log.is_file() else ""
        raise RuntimeError(f"census of {config_name} failed: {err}\n{text[-4000:]}") from None
    return json.loads((run_dir / "census.json").read_text())


def _census_child(rank: int, spec_path: str, log_path: str) -> None:
    """The training child of `census`: its output goes to the run's log.txt."""
    from qvl.foundation.distributed import output_to

    output_to(log_path)
    logging.basicConfig(level=logging.WARNING)
    census_worker(pathlib.Path(spec_path))


def recorded_graphs_check(name: str, out: pathlib.Path, eager: dict | None = None) -> dict:
    """The census's estimate of what the host launches in a step with speed-cuda-graphs (from `eager`, the config's
    census where already made), against that step trained with its CUDA graphs recorded on the CPU
    (`replays_counted`: each replay one launch, the ops it replays not counted)."""
    estimated = graphs_estimated(CONFIGS[name])
    estimate = (eager or census(name, out / "eager"))["cuda_graphs"]["host_launches"] if estimated else None
    recorded = census(name, out / "recorded", recorded_graphs=True)["step"]
    measured = recorded["kernel_launching_ops"]
    return {"config": name, "estimated_host_launches": estimate, "recorded_host_launches": measured,
            "graph_replays": recorded["ops"].get("cudaGraphLaunch", 0), "host_syncs": recorded["host_syncs"],
            "relative_difference": round(measured / estimate - 1, 4) if estimated else None}  # fmt: skip


def benchmark(names: list[str], out: pathlib.Path, *, baseline: bool = False, compile: bool = False,
              eager_regions: bool = False,
              calibrate: step_calibration.MeasuredStep | None = None) -> dict:  # fmt: skip
    """Censuses of `names` (the pre-change code path with `baseline`; `compile=True` with `compile`), the step-time
    estimates and the goals; with `calibrate` (a GPU run's measured step), the RESULTS.md configuration's estimate
    against it, then the model refitted to it (benchmarks.step_calibration)."""
    results: dict = {"baseline": baseline, "compile": compile, "eager_regions": eager_regions, "configs": {}}
    for name in names:
        logger.warning("census of %s ...", name)
        results["configs"][name] = census(name, out, baseline=baseline, compile=compile, eager_regions=eager_regions)
    before = json.loads(BEFORE_CENSUS.read_text()) if BEFORE_CENSUS.is_file() else None
    if before is None and baseline and MEASURED_CONFIG in results["configs"]:
        before = results["configs"][MEASURED_CONFIG]
    checks = []
    if before is not None:
        model, results["calibration"] = step_calibration.current_model(StepTimeModel.calibrated(before))
        if calibrate is not None:
            result = results["configs"][RESULTS_CONFIG]
            checks.append(step_calibration.estimate_check(model, result, calibrate))  # before the refit
            step_calibration.write_calibration(result, calibrate)
            model, results["calibration"] = step_calibration.current_model(StepTimeModel.calibrated(before))
        results["model"] = asdict(model)
        results["before"] = {"step": before["step"], "estimate": model.estimate(before["step"])}
        for name, result in results["configs"].items():
            if name != "tiny":
                result["estimate"] = model.estimate(result["step"], result.get("cuda_graphs"))
    if MEASURED_CONFIG in results["configs"]:
        measured = results["configs"][MEASURED_CONFIG]
        results["profile_match"] = profile_match(measured)
        if before is not None and not (baseline or compile):  # the 2026-11-26 run's step, against the first fit
            checks += second_profile_checks(measured, StepTimeModel.calibrated(before))
    if RESULTS_CONFIG in results["configs"]:
        result = results["configs"][RESULTS_CONFIG]
        if "estimate" in result:
            checks = goal_checks(result, result["estimate"]) + checks
    if checks:
        results["checks"] = checks
    (out / "bench_step.json").write_text(json.dumps(results, indent=1))
    step_plot.plot(results, out / "bench_step.png")
    return results


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: the tiny config (quick) or the real-shape configs of DEFAULT_CONFIGS, and the DPO step's
    figure (benchmarks.step_preference: vision tower passes per pair) with its check."""
    from benchmarks import step_preference

    names = ["tiny"] if quick else list(DEFAULT_CONFIGS)
    results = benchmark(names, out_dir)
    results["dpo"] = step_preference.census(out_dir)
    results["checks"] = results.get("checks", []) + results["dpo"]["checks"]
    (out_dir / "bench_step.json").write_text(json.dumps(results, indent=1))
    logger.warning("%s", table(results))
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line: run the censuses asked for, print the table (or JSON), write bench_step.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", nargs="+", choices=list(CONFIGS), help="configs (default: the real-shape ones, DEFAULT_CONFIGS)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench"))
    parser.add_argument("--quick", action="store_true", help="the tiny config only")
    parser.add_argument("--baseline", action="store_true", help="the pre-change code path (qvl's step fixes off)")
    parser.add_argument("--compile", action="store_true", help="the recipe's compile=True (vision blocks compiled)")
    parser.add_argument("--eager-regions", action="store_true", help="count compiled regions as their eager ops")
    parser.add_argument("--write-before", action="store_true", help=f"save the {MEASURED_CONFIG} census as the before")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--recorded-graphs", action="store_true",
                        help="the estimated host launches with CUDA graphs against the step trained with its graphs "
                        "recorded on the CPU (each replay one launch)")  # fmt: skip
    parser.add_argument(
        "--calibrate", type=pathlib.Path, metavar="BENCH_TRAIN_JSON",
        help=f"a GPU run's bench_train.json: {RESULTS_CONFIG}'s estimate against its measured packed 4k step, then "
        "the step model refitted to it (results/calibration.json)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = args.config or (["tiny"] if args.quick else list(DEFAULT_CONFIGS))
    if args.write_before and (MEASURED_CONFIG not in names or not args.baseline):
        print(f"error: --write-before needs --baseline and --config {MEASURED_CONFIG}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compile and args.baseline:
        print("error: --compile is an option of qvl's step; drop --baseline or --compile", file=sys.stderr)
        return 2
    if args.calibrate and (RESULTS_CONFIG not in names or args.baseline or args.compile or args.eager_regions):
        print(f"error: --calibrate needs the census of {RESULTS_CONFIG} as qvl trains it: --config {RESULTS_CONFIG} "
              "without --baseline, --compile or --eager-regions", file=sys.stderr)  # fmt: skip
        return 2
    if args.recorded_graphs:
        checks = [recorded_graphs_check(name, args.out / f"recorded-{name}") for name in names]
        (args.out / "bench_step_recorded_graphs.json").write_text(json.dumps(checks, indent=1))
        for check in checks:
            estimated = check["estimated_host_launches"]
            print(json.dumps(check) if args.json else
                  f"{check['config']}: host launches with CUDA graphs ESTIMATED "
                  f"{'(not modelled: sequential MoE experts or Gated DeltaNet)' if estimated is None else estimated}, recorded on "
                  f"the CPU {check['recorded_host_launches']} ({check['graph_replays']} replays, {check['host_syncs']} host "
                  "syncs)" + ("" if estimated is None else f": {check['relative_difference']:+.1%}"))  # fmt: skip
        return 0
    measured = None
    if args.calibrate:  # read before the censuses run: a file that cannot be fitted to ends the command at once
        try:
            measured = step_calibration.MeasuredStep.of_bench_train(args.calibrate)
        except (OSError, ValueError, KeyError) as error:
            print(f"error: --calibrate {args.calibrate}: {error}", file=sys.stderr)
            return 2
    results = benchmark(names, args.out, baseline=args.baseline, compile=args.compile, eager_regions=args.eager_regions,
                        calibrate=measured)  # fmt: skip
    if args.write_before:
        BEFORE_CENSUS.write_text(json.dumps(results["configs"][MEASURED_CONFIG], indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
