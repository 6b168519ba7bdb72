"""qvl's side of a preference parity run: the user's path, `qvl convert import`, `qvl reference`, `qvl train`, recorded.

The HF checkpoint is imported to a Megatron checkpoint (or `pretrained_checkpoint=DIR` is one already), the recipe's
reference log-probs are computed by qvl's own reference pass over the dataset (`reference=DIR`, reused where it is up
to date; none for SimPO or `reference=adapters`), and the recipe trains from that checkpoint through Megatron-Bridge's
`finetune()` with qvl's preference step (qvl.training.preference), as `qvl train` runs it: the adapters of a
`*_dpo_peft` recipe go on through Megatron-Bridge's own PEFT hook after the checkpoint loads. The callbacks of the SFT
check record each step's loss, gradient norm and learning rate, step 1's gradients and the final weights under HF
names (qvl.training.parity.megatron_run), and each step's rewards as the loop reports them; the step's loss function
is wrapped to keep each pair's log-probs, reference log-probs and loss as qvl's own loss code scored them, and step
1's per-token losses of every side.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from qvl.training.parity.adapters import take_adapters
from qvl.training.parity.megatron_run import (
    MegatronRun,
    Recording,
    conversation_token_losses,
    parity_callbacks,
    recorded_batches,
    start_runtime,
    training_config,
)
from qvl.training.parity.preference_pairs import REWARDS, PairRecord, Scores

logger = logging.getLogger(__name__)
IMPORT_DIR = "import"  # under the qvl run's folder: the HF checkpoint as `qvl convert import` writes it
REFERENCE_DIR = "reference"  # under the qvl run's folder: the reference pass's table, unless reference=DIR


def import_checkpoint(hf_path: Path, out: Path, *, device: str) -> Path:
    """`qvl convert import HF OUT --dtype fp32`: the checkpoint qvl's side starts from (one process, this one)."""
    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    logger.info("qvl: importing %s to %s (fp32)", hf_path, out)
    run_on_ranks(convert.import_on_rank, str(hf_path), str(out), "fp32", 1, 1, cpu=device == "cpu")
    return out


def preference_of(run: MegatronRun):
    """The recipe's preference settings under the run's options (qvl.recipes.preference.PreferenceConfig)."""
    return _config(run)[1].qvl.preference


def ensure_reference(run: MegatronRun) -> Path | None:
    """`qvl reference RECIPE ...` with the run's options: the reference folder, computed unless it is up to date for
    this dataset and checkpoint; None where the recipe needs none (SimPO, reference=adapters)."""
    from qvl.data.reference import read_source
    from qvl.kernels import torch_gated_delta
    from qvl.training.reference import compute_reference, reference_run

    _, config = _config(run)
    if config.qvl.preference.reference != "precomputed":
        return None
    pass_ = reference_run(run.recipe, config)
    if read_source(pass_.out) == pass_.source:
        logger.info("qvl: reference %s is up to date for this dataset and checkpoint", pass_.out)
        return pass_.out
    logger.info("qvl: the reference pass of %s over %s into %s", run.recipe, run.data, pass_.out)
    # the delta rule the training step runs (token by token, as the TRL side, unless a chunked one is checked)
    if run.delta_rule == "recurrence":
        config.model.register_pre_wrap_hook(torch_gated_delta.token_by_token)
    compute_reference(config, pass_, device=run.device)
    return pass_.out


def _config(run: MegatronRun):
    """The recipe's ConfigContainer for the parity run, starting from its pretrained checkpoint as `qvl train` does."""
    info, config = training_config(run)
    config.checkpoint.pretrained_checkpoint = run.options["pretrained_checkpoint"]
    return info, config


class PreferenceRecordingStep:
    """qvl's preference forward step, unchanged, with the micro-batches, step 1's per-token losses and every pair's
    scores recorded (`batch_hook` changes each batch on purpose before the step: tests)."""

    def __init__(self, recording: Recording, pairs: list[PairRecord], batch_hook: Callable | None = None):
        self.recording, self.pairs, self.batch_hook = recording, pairs, batch_hook

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False, *, loss_check=None):
        from qvl.training.preference import preference_forward_step

        step = state.train_state.step + 1
        iterator = recorded_batches(data_iterator, self.recording, step, self.batch_hook, model)
        output, loss_func = preference_forward_step(state, iterator, model, return_schedule_plan, loss_check=loss_check)
        return output, partial(self._scored, loss_func, self.recording.micro_batches[-1], step)

    def _scored(self, loss_func: partial, record, step: int, output_tensor):
        """The step's loss function, and what it scored: every pair, through the functions the step's loss calls
        (qvl.training.preference's `side_logps` and `pair_losses`, on its own arguments), step 1's token losses."""
        from qvl.training import preference as step_code

        result = loss_func(output_tensor)
        layout, loss_mask, settings, reference = loss_func.args  # qvl.training.preference.preference_loss's
        if isinstance(output_tensor, tuple):
            output_tensor, loss_mask = output_tensor
        if step == 1:
            record.token_losses = output_tensor.detach().reshape(-1).clone()
            record.loss_mask = loss_mask.detach().reshape(-1).clone()
        logps = step_code.side_logps(output_tensor, loss_mask, layout).detach()
        scored = step_code.pair_logps(layout, logps, reference)
        losses, metrics = step_code.pair_losses(scored, settings)
        reference = settings.needs_reference
        for k in range(layout.pairs):
            self.pairs.append(
                PairRecord(
                    step=step,
                    loss=float(losses[k].detach()),
                    logp_chosen=float(metrics["logp chosen"][k]),
                    logp_rejected=float(metrics["logp rejected"][k]),
                    ref_logp_chosen=float(metrics["ref logp chosen"][k]) if reference else None,
                    ref_logp_rejected=float(metrics["ref logp rejected"][k]) if reference else None,
                    reward_margin=float(metrics["reward margin"][k]),
                )
            )
        return result


def step_rewards(loss_dict: dict) -> dict[str, float]:
    """A step's rewards as qvl's loop reported them (qvl.training.preference_loss.METRICS, means over its pairs)."""
    from qvl.training.loop import reduced_loss

    return {name: reduced_loss(loss_dict[name.replace("_", " ")]) for name in REWARDS}


def run_preference_megatron(run: MegatronRun) -> tuple[Recording, Scores, Any]:
    """Train `run.steps` steps of a preference recipe from `run.options["pretrained_checkpoint"]` with
    Megatron-Bridge's loop; what it did, what it scored, and the ConfigContainer it ran."""
    from qvl.bridges.convert import auto_bridge_with_weights

    start_runtime(run.device)
    from qvl.kernels import torch_gated_delta
    from qvl.training.loop import run_megatron_loop
    from qvl.training.preference import PREFERENCE_LOSS

    _, config = _config(run)
    bridge = auto_bridge_with_weights(run.hf_path, config.model.params_dtype)  # HF names for the export
    if run.delta_rule == "recurrence":
        config.model.register_pre_wrap_hook(torch_gated_delta.token_by_token)
    # the checks of the PEFT check (one process, no dropout); Megatron-Bridge's own PEFT hook then applies the
    # adapters after the pretrained checkpoint loads, as `qvl train` does (and reference=adapters switches them off)
    config.peft = adapters = take_adapters(config, run.options)
    recording, scores = Recording(), Scores(pairs=[], rewards=[])
    callbacks = parity_callbacks(bridge, recording, adapters, run.hf_path, loss_key=PREFERENCE_LOSS)
    callbacks.register("on_train_step_end", lambda context: scores.rewards.append(step_rewards(context.loss_dict)))
    step = PreferenceRecordingStep(recording, scores.pairs, run.batch_hook)
    run_megatron_loop(config, step, callbacks, loop="finetune")
    recording.token_losses = conversation_token_losses(recording.micro_batches)
    return recording, scores, config


def with_start(run: MegatronRun, *, checkpoint: Path, reference: Path | None) -> MegatronRun:
    """`run` starting from `checkpoint`, reading its precomputed reference from `reference` (where it has one)."""
    options = {**run.options, "pretrained_checkpoint": str(checkpoint)}
    if reference is not None:
        options["reference"] = str(reference)
    return dataclasses.replace(run, options=options)
