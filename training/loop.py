"""Training a recipe (`qvl train RECIPE [key=value ...]`, parsed in qvl.launchers.commands.recipes) through Megatron-Bridge's own pretrain/finetune loop.

`--model tiny` swaps the recipe's published architecture for a tiny random model of the same family
(written as an HF checkpoint in the run directory), and `--device cpu` runs it through qvl's CPU
runtime, so the whole training path runs on a laptop. Every step's loss is appended to
`RUN_DIR/losses.jsonl` (rank 0) for plots, tests and resume checks.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qvl.bridges.checkpoints import check_megatron_checkpoint, has_checkpoint, keep_hf_side
from qvl.foundation import megatron, runtime
from qvl.foundation.distributed import forget_model_parallel_leftovers
from qvl.foundation.errors import ConfigError
from qvl.foundation.rendezvous import rendezvous_environment
from qvl.kernels import switch
from qvl.recipes.options import check_data_folder, check_option_names
from qvl.recipes.overrides import Overrides, apply_config_overrides
from qvl.recipes.registry import get_recipe

logger = logging.getLogger(__name__)
LOSSES_FILE = "losses.jsonl"
LM_LOSS = "lm loss"  # Megatron-Bridge's reporting key of the language-model loss
# Overrides a CPU run needs: fp32 (no bf16 kernels worth using).
CPU_OVERRIDES = {"precision": "fp32"}


@dataclass(kw_only=True, slots=True)
class TrainRequest:
    """What to train, where, and how."""

    recipe: str
    overrides: dict[str, Any]
    run_dir: Path
    model: str | None = None  # "tiny" for a tiny random model of the recipe's family
    device: str = "auto"  # "cpu" forces the CPU runtime
    stop_after: int | None = None  # save and exit after this many steps, as a preempted job would


def prepare_config(request: TrainRequest, *, cpu: bool | None = None, tiny_dir: Path | None = None):
    """The recipe's ConfigContainer with the request's model, device and run-directory settings.

    `cpu` defaults to this machine (`--device cpu` or no CUDA); `qvl launch --dryrun` passes the executor's.
    `tiny_dir` is where `--model tiny` writes its checkpoint (default RUN_DIR/tiny-hf)."""
    from qvl.recipes.base import attach_qvl_behaviours  # imports Megatron-Bridge

    info = get_recipe(request.recipe)
    # `section.field=value` pairs set fields of the built ConfigContainer; the rest are recipe options.
    split = Overrides.of(request.overrides)
    overrides, dotted = split.options, split.config
    check_option_names(overrides)
    cpu = (request.device == "cpu" or not torch.cuda.is_available()) if cpu is None else cpu
    if request.model == "tiny" and "hf_path" not in overrides:
        from qvl.bridges.tiny_model import write_tiny_hf_checkpoint  # transformers

        hf_path = tiny_dir or request.run_dir / "tiny-hf"
        if not (hf_path / "config.json").is_file():
            write_tiny_hf_checkpoint(hf_path, info.family)
        overrides["hf_path"] = str(hf_path)
    if request.model == "tiny":  # a tiny model on one process: no parallelism unless asked for
        overrides = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, **overrides}
    if cpu:
        overrides = {**CPU_OVERRIDES, **overrides}
    overrides.setdefault("checkpoint_dir", str(request.run_dir / "checkpoints"))
    overrides.setdefault("tensorboard_dir", str(request.run_dir / "tensorboard"))
    config = info.fn(**overrides)
    if dotted:
        apply_config_overrides(config, dotted)
    attach_qvl_behaviours(config)  # validate() does it again (once) under Megatron-Bridge's loop
    if cpu:
        runtime.cpu_training_config(config)
    if request.stop_after:
        config.train.exit_interval = request.stop_after  # Megatron-Bridge saves a checkpoint and exits
    return info, config


def check_inputs(info, config, run_dir: Path) -> None:
    """Refuse, before any model is built, what Megatron-Bridge would only find after: a layout this machine cannot
    build, no pretrained checkpoint for a fine-tune, a missing or truncated checkpoint, a missing dataset, an
    unwritable run directory."""
    from qvl.recipes.datasets import check_dataset, check_dataset_matches_recipe

    check_layout_runs_here(config.model)
    check_writable("--run-dir", run_dir)
    if config.checkpoint.save:  # checkpoint.save=none trains without saving
        check_writable("checkpoint_dir", Path(config.checkpoint.save))
    resuming = has_checkpoint(Path(config.checkpoint.load)) if config.checkpoint.load else False
    pretrained = config.checkpoint.pretrained_checkpoint
    if info.stage != "pretrain" and not pretrained and not resuming:
        raise ConfigError(
            f"recipe {info.name} fine-tunes a converted model but pretrained_checkpoint is not set; pass "
            "pretrained_checkpoint=DIR, a Megatron checkpoint written by `qvl convert import HF_DIR DIR`"
        )
    if pretrained and not resuming:
        check_megatron_checkpoint(Path(pretrained), "pretrained_checkpoint")
    check_dataset(config.dataset)
    config.set_data_parallel_size()  # from WORLD_SIZE, as Megatron-Bridge's runtime_config_update does
    check_dataset_matches_recipe(config)


def check_layout_runs_here(model: Any) -> None:
    """Refuse a parallel layout that this machine's packages cannot build (each rank would fail an assertion while
    building its model): context parallelism, whose only attention in Megatron-Core is Transformer Engine's."""
    cp = getattr(model, "context_parallel_size", 1) or 1
    if cp > 1 and not megatron.have_transformer_engine():
        raise ConfigError(
            f"context_parallel={cp} needs Transformer Engine: Megatron-Core's only context-parallel attention is TE's, "
            "and without TE qvl's attention keeps each sequence on one rank; train where TE is installed (a NeMo "
            "container has it), or set context_parallel=1"
        )


def check_writable(what: str, path: Path) -> None:
    """Refuse an output folder that cannot be created or written (named by its flag)."""
    existing = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{what}={path} cannot be written ({existing} is not a writable folder); choose a folder you can write"
        )


class _CleanExitFilter(logging.Filter):
    """Megatron-Bridge's pretrain() logs every BaseException as "Pretrain failed ..." with a traceback, including
    the SystemExit(0) it raises itself after saving at exit_interval (`--stop-after`): a planned stop is no failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, SystemExit) and error.code in (0, None))


class _LossRecorder:
    """on_train_step_end callback: append {"step", "loss"} and every other value the step reported ("mtp_loss" where
    multi-token prediction trains, qvl.training.mtp; a preference run's rewards, qvl.training.preference) to
    RUN_DIR/losses.jsonl from the one rank that holds the reduced loss: first tensor- and data-parallel rank of the
    last pipeline stage. `main` is the reporting key of the stage's loss ("lm loss" for pretraining and SFT)."""

    def __init__(self, path: Path, main: str = LM_LOSS):
        self.path = path
        self.main = main

    def __call__(self, context) -> None:
        from megatron.core import parallel_state as ps

        if not context.loss_dict or not ps.is_pipeline_last_stage(ignore_virtual=True):
            return
        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
            return
        # train_state.step still counts completed steps before this one: record 1-based iterations
        record = {"step": context.state.train_state.step + 1, "loss": reduced_loss(context.loss_dict.get(self.main))}
        for key, value in context.loss_dict.items():
            if key != self.main:
                record[key.replace(" ", "_")] = reduced_loss(value)  # "mtp loss" -> "mtp_loss"
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def reduced_loss(loss) -> float:
    """A reported loss as one number: (sum, tokens) pairs divided."""
    return float(loss[0] / loss[1]) if isinstance(loss, (tuple, list)) else float(loss)


def run_training(request: TrainRequest) -> Path:
    """`qvl train`: the recipe's config with the request's settings, trained by `train`."""
    check_writable("--run-dir", request.run_dir)
    data = Overrides.of(request.overrides).options.get("data")
    if data is not None:  # before Megatron-Bridge's import (~15 s of CPU): a rank without its dataset ends at once
        check_data_folder(data)
    cpu = request.device == "cpu" or not torch.cuda.is_available()
    if cpu:  # switched on before any of Megatron is built, as train() would
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    # The config lives in a callee's frame, so that it is garbage once the run returns: with PEFT it is in a cycle
    # (Megatron-Bridge's pre-wrap hook on the provider closes over the run's state, which names the config), and the
    # provider holds the run's process groups, so collect once that frame is gone.
    run_dir = _train_request(request, cpu)
    gc.collect()
    return run_dir


def _train_request(request: TrainRequest, cpu: bool) -> Path:
    info, config = prepare_config(request)
    check_inputs(info, config, request.run_dir)
    return train(
        config,
        run_dir=request.run_dir,
        loop="pretrain" if info.stage == "pretrain" else "finetune",
        device="cpu" if cpu else "auto",
        stop_after=request.stop_after,
    )


def train(
    config: Any,
    *,
    run_dir: Path | str,
    loop: str | None = None,
    device: str = "auto",
    stop_after: int | None = None,
) -> Path:
    """Train a recipe's ConfigContainer with Megatron-Bridge's `pretrain()` / `finetune()` and qvl's forward step.

    The same path `qvl train` takes, for notebooks and scripts:

        >>> from qvl.recipes.qwen2_5_vl import qwen2_5_vl_3b_sft
        >>> config = qwen2_5_vl_3b_sft(hf_path=..., data=..., pretrained_checkpoint=...)
        >>> config.train.train_iters = 50
        >>> train(config, run_dir="runs/sft")      # losses in runs/sft/losses.jsonl (read_losses)

    `loop`: "pretrain" or "finetune" (default: finetune when the config names a pretrained checkpoint).
    `device="cpu"` (or no CUDA) runs through qvl's CPU runtime; `stop_after` saves and exits after that many
    steps, as a preempted job would, and the same call again resumes. Returns the run directory."""
    run_dir = Path(run_dir)
    check_writable("--run-dir", run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if loop is None:
        loop = "finetune" if config.checkpoint.pretrained_checkpoint else "pretrain"
    if loop not in ("pretrain", "finetune"):
        raise ConfigError(f"loop={loop!r} is not one of pretrain, finetune")
    if device == "cpu" or not torch.cuda.is_available():
        runtime.activate(force=True)
        runtime.enable_bridge_training()
        runtime.cpu_training_config(config)
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager  # Megatron-Bridge: heavy, loaded on use

    import qvl.bridges.registration  # noqa: F401  (registers qvl's bridges with Megatron-Bridge)

    stage = stage_step(config)
    keep_hf_side(config)  # the pretrained checkpoint's HF side with the run's checkpoints: export needs nothing else
    if stop_after:
        config.train.exit_interval = stop_after  # Megatron-Bridge saves a checkpoint and exits
    callbacks = CallbackManager()
    callbacks.register("on_train_step_end", _LossRecorder(run_dir / LOSSES_FILE, main=stage.loss_key))
    clean_exit = _CleanExitFilter()
    pretrain_logger = logging.getLogger("megatron.bridge.training.pretrain")
    pretrain_logger.addFilter(clean_exit)
    try:
        run_megatron_loop(config, stage.forward_step, callbacks, loop=loop)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
        logger.info("stopped after %s steps as asked; the same call resumes", stop_after)
    finally:
        pretrain_logger.removeFilter(clean_exit)
    return run_dir


@dataclass(kw_only=True, slots=True, frozen=True)
class StageStep:
    """What a training stage hands Megatron-Bridge's loop: its forward step and the reporting key of its loss."""

    forward_step: Any
    loss_key: str


def stage_step(config: Any) -> StageStep:
    """The forward step a config trains with: a preference stage's (qvl.training.preference) where the config's
    `qvl.preference` is set, else the language-model step of pretraining, SFT and PEFT (qvl.training.step)."""
    if getattr(getattr(config, "qvl", None), "preference", None) is not None:
        from qvl.training.preference import PREFERENCE_LOSS, preference_forward_step  # Megatron-Core

        return StageStep(forward_step=preference_forward_step, loss_key=PREFERENCE_LOSS)
    from qvl.training.step import forward_step  # Megatron-Core

    return StageStep(forward_step=forward_step, loss_key=LM_LOSS)


def run_megatron_loop(config: Any, forward_step: Any, callbacks: Any, *, loop: str = "pretrain") -> None:
    """Megatron-Bridge's `pretrain()` / `finetune()` with what every qvl run needs around it: the patch groups the
    switch decides for this config on this process's device (qvl.kernels.switch: exact resume with torch Adam, the
    wheel's prebuilt dataset helpers, the faster paths where TE and Apex are absent, ...), applied for the loop only;
    qvl's rendezvous rule; and no rerun-state singleton or MoE metrics tracker left behind by a run earlier in this
    process (a test, a notebook): `pretrain()` asserts there is no rerun state, and the tracker sizes its per-layer
    entries by the first MoE model it saw, so a later model with more layers (or MTP layers) would index past them.
    Nor an MoE auxiliary-loss scale: a backward through an MoE layer outside a loop leaves a 0-d one, and the loop's
    `set_loss_scale` copies its 1-element scale into it ("output with shape [] doesn't match the broadcast shape
    [1]")."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if loop == "pretrain":
        from megatron.bridge.training.pretrain import pretrain as run_loop
    else:
        from megatron.bridge.training.finetune import finetune as run_loop
    destroy_rerun_state_machine()
    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # set again from the loop's first scale
    # One rule for every launch (torchrun, srun starting each rank, one process), set for this loop only: the
    # process group outlives the loop and holds the port, so a process started afterwards from here must not
    # inherit it.
    if callbacks is None:
        from megatron.bridge.training.callbacks import CallbackManager

        callbacks = CallbackManager()
    trained = _TrainedModel()
    callbacks.register("on_train_start", trained)
    try:
        with rendezvous_environment(), switch.applied_for_training(switch.Target.of(config)):
            run_loop(config, forward_step, callbacks=callbacks)
    finally:
        trained.release()
        forget_model_parallel_leftovers()
        gc.collect()  # the rest of the run's cycles (PEFT's, the data pipeline's): their process groups' threads go now


class _TrainedModel:
    """on_train_start callback that keeps the loop's model chunks, so that the loop's end can release them.

    Megatron-Core's DDP hooks each parameter's gradient accumulator (a C++ autograd node) with a closure over the DDP
    module, and keeps the accumulators: a cycle through C++ that Python's collector cannot see, so a finished run's
    model, optimizer and process groups (two gloo threads and a TCP loop each, ~20 groups per run) would live as long
    as the process: a notebook or a test process running loop after loop gathered thousands of threads. Emptying the
    accumulators' hook dictionaries (the dictionary a new hook's handle names) breaks the cycle; the loop's state
    then lets go of what Megatron-Bridge resets between in-process restarts (its TensorBoard writer and thread, the
    config's references to the optimizer)."""

    def __init__(self):
        self.model: list = []
        self.state: Any = None

    def __call__(self, context) -> None:
        self.model, self.state = list(context.model), context.state

    def release(self) -> None:
        release_run(self.model, self.state)
        self.model, self.state = [], None


def release_run(model: list, state: Any) -> None:
    """Let a finished run's model chunks and Megatron-Bridge state go (see _TrainedModel): the DDP gradient
    accumulators' hooks emptied, the state reset as an in-process restart resets it. Collect afterwards."""
    if state is not None:
        state.reset_for_restart()
    for chunk in model:
        accumulators = getattr(chunk, "grad_accs", [])
        for accumulator in accumulators:
            accumulator.register_hook(_no_hook).hooks_dict_ref().clear()
        accumulators.clear()


def _no_hook(*_: Any) -> None:
    return None


def read_losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Step -> loss (or another recorded value, e.g. "mtp_loss") from a run directory (a resumed run appends; the
    latest entry per step wins)."""
    path = Path(run_dir) / LOSSES_FILE
    if not path.is_file():
        return {}
    return {r["step"]: r[key] for r in map(json.loads, path.read_text().splitlines()) if key in r}
