"""Training a recipe (`qvl train RECIPE [key=value ...]`, parsed in qvl.launchers.commands.recipes) through Megatron-Bridge's own pretrain/finetune loop.

`--model tiny` swaps the recipe's published architecture for a tiny random model of the same family
(written as an HF checkpoint in the run directory), and `--device cpu` runs it through qvl's CPU
runtime, so the whole training path runs on a laptop. Every step's loss is appended to
`RUN_DIR/losses.jsonl` (rank 0) for plots, tests and resume checks.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
LOSSES_FILE = "losses.jsonl"
# Overrides a CPU run needs: fp32 (no bf16 kernels worth using), no sequence parallelism (needs TE norms).
CPU_OVERRIDES = {"precision": "fp32", "sequence_parallel": False}


@dataclass(kw_only=True, slots=True)
class TrainRequest:
    """What to train, where, and how."""

    recipe: str
    overrides: dict[str, Any]
    run_dir: Path
    model: str | None = None  # "tiny" for a tiny random model of the recipe's family
    device: str = "auto"  # "cpu" forces the CPU runtime
    stop_after: int | None = None  # save and exit after this many steps, as a preempted job would


def tiny_family(recipe_family: str, size: str) -> str:
    """The bridges.testing family for a recipe: MoE sizes (e.g. 30b_a3b) use the tiny MoE model."""
    return "qwen3_vl_moe" if recipe_family == "qwen3_vl" and "_a" in size else recipe_family


def prepare_config(request: TrainRequest):
    """The recipe's ConfigContainer with the request's model, device and run-directory settings."""
    from qvl.recipes.registry import get_recipe

    info = get_recipe(request.recipe)
    # `section.field=value` pairs set fields of the built ConfigContainer; the rest are recipe arguments.
    dotted = {k: v for k, v in request.overrides.items() if "." in k}
    overrides = {k: v for k, v in request.overrides.items() if "." not in k}
    cpu = request.device == "cpu" or not torch.cuda.is_available()
    if request.model == "tiny" and "hf_path" not in overrides:
        from qvl.bridges.tiny import write_tiny_hf_checkpoint

        hf_dir = request.run_dir / "tiny-hf"
        if not (hf_dir / "config.json").is_file():
            write_tiny_hf_checkpoint(hf_dir, tiny_family(info.family, info.size))
        overrides["hf_path"] = str(hf_dir)
    if request.model == "tiny":  # a tiny model on one process: no parallelism unless asked for
        overrides = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, **overrides}
    if cpu:
        overrides = {**CPU_OVERRIDES, **overrides}
    overrides.setdefault("checkpoint_dir", str(request.run_dir / "checkpoints"))
    overrides.setdefault("tensorboard_dir", str(request.run_dir / "tensorboard"))
    config = info.fn(**overrides)
    if dotted:
        from qvl.recipes.overrides import apply_config_overrides

        apply_config_overrides(config, dotted)
    if cpu:
        from qvl.foundation import runtime

        config.dist.distributed_backend = "gloo"
        config.dataset.num_workers = 0
        config.dataset.pin_memory = False
        runtime.check_cpu_config(config.model)
    if request.stop_after:
        config.train.exit_interval = request.stop_after  # Megatron-Bridge saves a checkpoint and exits
    return info, config


class _LossRecorder:
    """on_train_step_end callback: append {"step", "loss"} to RUN_DIR/losses.jsonl from the one rank that
    holds the reduced loss: first tensor- and data-parallel rank of the last pipeline stage."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, context) -> None:
        from megatron.core import parallel_state as ps

        if not context.loss_dict or not ps.is_pipeline_last_stage(ignore_virtual=True):
            return
        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
            return
        loss = context.loss_dict.get("lm loss")
        value = float(loss[0] / loss[1]) if isinstance(loss, (tuple, list)) else float(loss)
        with self.path.open("a") as f:
            # train_state.step still counts completed steps before this one: record 1-based iterations
            f.write(json.dumps({"step": context.state.train_state.step + 1, "loss": value}) + "\n")


def run_training(request: TrainRequest) -> Path:
    """Train; returns the run directory (checkpoints/, losses.jsonl, tensorboard/)."""
    from qvl.foundation import distributed, megatron, runtime

    request.run_dir.mkdir(parents=True, exist_ok=True)
    if "MASTER_PORT" not in os.environ:  # not under torchrun: a free port, not the fixed default 29500
        os.environ["MASTER_PORT"] = str(distributed.free_port())
    if request.device == "cpu" or not torch.cuda.is_available():
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    megatron.import_megatron_bridge()
    from megatron.bridge.training.callbacks import CallbackManager

    import qvl.bridges.registry  # noqa: F401
    from qvl.recipes.training import optimizer_fixes

    optimizer_fixes.apply()  # resume correctness with torch Adam (no TE/Apex), on any device

    info, config = prepare_config(request)
    callbacks = CallbackManager()
    callbacks.register("on_train_step_end", _LossRecorder(request.run_dir / LOSSES_FILE))
    from qvl.recipes.training.step import forward_step

    if info.stage == "pretrain":
        from megatron.bridge.training.pretrain import pretrain as loop
    else:
        from megatron.bridge.training.finetune import finetune as loop
    loop(config, forward_step, callbacks=callbacks)
    return request.run_dir


def read_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss from a run directory (a resumed run appends; the latest entry per step wins)."""
    path = Path(run_dir) / LOSSES_FILE
    if not path.is_file():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}
