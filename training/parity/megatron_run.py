"""qvl's side of a parity run: the recipe trained for a few steps by Megatron-Bridge's own loop, recorded.

The loop is `pretrain()` with qvl's forward step (qvl.training.step), the recipe's optimizer, schedule,
DDP and loss settings, reading the offline packs through qvl's loader; the weights come from the HF checkpoint
through the bridge (a pre-wrap hook: the same tensors `qvl convert import` writes). Callbacks record each step's
loss, gradient norm and learning rate, the first step's gradients and the final weights under HF names (exported
through the bridge's own mapping, so a fused QKV or expert tensor is compared piece by piece), and the forward
step records every micro-batch it consumed with its per-token losses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from qvl.foundation import megatron, runtime
from qvl.kernels import switch
from qvl.training.mtp import MTP_LOSS, LossesWithMtp
from qvl.training.parity import decay
from qvl.training.parity.adapters import AdapterRecord, adapter_hook, take_adapters
from qvl.training.parity.moe_aux import LOAD_BALANCING_NAMES

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class MicroBatchRecord:
    """One micro-batch the loop consumed: the packed batch, and the per-token losses and loss mask of step 1."""

    step: int  # 1-based optimizer step
    batch: Any  # the loader's PackedBatch, as read (before any `batch_hook`)
    token_losses: torch.Tensor | None = None  # [T] per-token loss (step 1 only)
    loss_mask: torch.Tensor | None = None  # [T] the mask the loss used (step 1 only)


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """One optimizer step as the loop reported it."""

    step: int
    loss: float  # learned-token mean over the global batch
    grad_norm: float  # before clipping
    lr: float
    mtp_loss: float | None = None  # learned-token mean of the MTP loss over the global batch (MTP trained)
    # Megatron-Core's load-balancing loss as its router logs it (each MoE layer's loss over the coefficient), summed
    # over the step's layers and micro-batches; None where the loss is off
    moe_aux_loss: float | None = None


@dataclass(kw_only=True, slots=True)
class Recording:
    """What one framework did over K steps, in HF parameter names."""

    steps: list[StepRecord] = field(default_factory=list)
    micro_batches: list[MicroBatchRecord] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # step 1, after clipping
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step
    # parameters (HF module names) that Megatron's rule and transformers' Trainer rule treat differently
    decay_rules_differ: list[str] = field(default_factory=list)
    # which rank recorded this: data-parallel rank, tensor-parallel rank, last pipeline stage (losses live there)
    rank: tuple[int, int, bool] = (0, 0, True)
    # step 1, per conversation of L tokens: (loss of the prediction made at each position [L], learned or not [L])
    token_losses: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # a PEFT recipe's adapters as the reference starts from them (qvl.training.parity.adapters.AdapterRecord)
    adapters: Any = None
    # HF name -> the weight decay the optimizer this framework built applies to it (qvl.training.parity.decay)
    decay: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class MegatronRun:
    """Which recipe to train, on what, for how long; `batch_hook` changes a batch on purpose (tests)."""

    recipe: str
    hf_path: Path
    data: Path
    run_dir: Path
    steps: int
    global_batch_size: int
    options: dict[str, Any] = field(default_factory=dict)  # further recipe options (lr=..., warmup_iters=...)
    device: str = "cpu"
    # Gated DeltaNet: "recurrence" swaps qvl's torch kernel to the token-by-token rule; "chunked" keeps the layer's
    # chunked rule (fla's where it runs, else Megatron-Core's torch kernel)
    delta_rule: str = "recurrence"
    batch_hook: Callable[[Any, Any], Any] | None = None  # (batch, model) -> batch, before the forward step


class _RecordingIterator:
    """The loop's data iterator, keeping every micro-batch it hands out."""

    def __init__(self, inner, recording: Recording, step: int):
        self.inner, self.recording, self.step = inner, recording, step

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.recording.micro_batches.append(MicroBatchRecord(step=self.step, batch=batch))
        return batch


class RecordingForwardStep:
    """qvl's forward step, unchanged, with the micro-batches and step-1 per-token losses recorded."""

    def __init__(self, recording: Recording, batch_hook: Callable[[Any, Any], Any] | None = None):
        self.recording, self.batch_hook = recording, batch_hook

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False, *, loss_check=None):
        from qvl.training.step import forward_step

        step = state.train_state.step + 1
        iterator = recorded_batches(data_iterator, self.recording, step, self.batch_hook, model)
        output, loss_func = forward_step(state, iterator, model, return_schedule_plan, loss_check=loss_check)
        if step == 1 and self.recording.rank[2]:  # earlier pipeline stages return activations, not losses
            record = self.recording.micro_batches[-1]
            main, main_loss = (
                (output.main, loss_func.args[0]) if isinstance(output, LossesWithMtp) else (output, loss_func)
            )
            record.token_losses = main.detach().reshape(-1).clone()
            record.loss_mask = main_loss.args[0].detach().reshape(-1).clone()
        return output, loss_func


def recorded_batches(data_iterator, recording: Recording, step: int, batch_hook: Callable | None, model):
    """The loop's data iterator with every micro-batch recorded as read, then changed by `batch_hook` (tests)."""
    iterator = _RecordingIterator(data_iterator, recording, step)
    return iterator if batch_hook is None else _Hooked(iterator, lambda batch: batch_hook(batch, model))


class _Hooked:
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def __iter__(self):
        return self

    def __next__(self):
        return self.hook(next(self.inner))


def _gradient(param: torch.Tensor) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)  # Megatron DDP accumulates into main_grad, not .grad
    if grad is None:
        grad = param.grad
    return torch.zeros_like(param) if grad is None else grad.view_as(param)


def export_hf(bridge, model: list, *, grads: bool) -> dict[str, torch.Tensor]:
    """The model's weights, or its gradients, under HF names through the bridge's mapping (gathered over TP/PP).

    The mappings rearrange tensors (split, concatenate, interleave), some also add a constant (Qwen3.5-VL's
    zero-centred norms are stored as w - 1 on one side): a gradient maps through the linear part alone, so it is
    exported as export(g) - export(0), in float64: in fp32, (g + 1) - 1 keeps only 2^-24 of g's scale (a norm
    gradient of 1e-4 came back 2e-4 off relative, which looked like a training difference)."""
    if not grads:
        return _export(bridge, model, None)
    return export_values(bridge, model, lambda p: _gradient(p).double())


def export_values(bridge, model: list, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`value_of(parameter)` in each parameter's place, through the linear part of the bridge's mappings (see
    `export_hf`), under HF names."""
    tasks = bridge.get_conversion_tasks(model)
    exported = _export(bridge, model, _with_weights(tasks, lambda p: value_of(p).double()), torch.float64)
    offsets = _export(bridge, model, _with_weights(tasks, lambda p: torch.zeros_like(p, dtype=torch.float64)), None)
    return {name: (tensor - offsets[name].double()).float() for name, tensor in exported.items()}


def _with_weights(tasks: list, weight_of: Callable[[torch.Tensor], torch.Tensor]) -> list:
    return [
        t if t.param_weight is None else dataclasses.replace(t, param_weight=weight_of(t.param_weight)) for t in tasks
    ]


def _export(bridge, model: list, tasks: list | None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    exported = bridge.export_hf_weights(model, cpu=True, show_progress=False, conversion_tasks=tasks)
    # identity mappings hand back the live tensor itself: copy it before the next step changes it
    return {name: tensor.detach().clone().to(dtype or tensor.dtype) for name, tensor in exported}


def _load_balancing_loss(model_config: Any) -> float | None:
    """The step's load-balancing loss as the routers add it, coefficient included, from Megatron-Core's MoE metrics
    tracker (which holds it over the coefficient), read before the loop's logging reduces and clears it, and reduced
    as that logging does (collective): each loss summed over the group its router's statistics span (a pack's
    tensor-parallel shares) and over the pipeline stages' layers. The parity check keeps the loss off where ranks
    train different packs. None where it is off (the loop's logging creates the tracker's entries all the same)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    coefficient = getattr(model_config, "moe_aux_loss_coeff", 0)
    if not coefficient:
        return None
    metrics = get_moe_metrics_tracker().metrics
    entries = [metrics[name] for name in LOAD_BALANCING_NAMES if name in metrics]
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if not entries and stages == 1:
        return None
    device = entries[0].values.device if entries else torch.device(switch.current_device())
    total = torch.zeros((), device=device)  # where the process group's backend reduces (NCCL: the GPU)
    for entry in entries:
        value = entry.values.sum()
        if entry.reduce_group is not None and entry.reduce_group.size() > 1:
            torch.distributed.all_reduce(value, group=entry.reduce_group)
        total = total + value
    if stages > 1:  # a stage without MoE layers holds no entry and adds nothing
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return float(total) * coefficient


def _mean_loss(loss_dict: dict | None, key: str) -> float | None:
    """A loss the loop reported under `key`, as one number; None where absent (earlier pipeline stages)."""
    from qvl.training.loop import reduced_loss

    return reduced_loss(loss_dict[key]) if loss_dict and key in loss_dict else None


class ParityCallback:
    """Megatron-Bridge callback recording losses, gradient norms, learning rates, step-1 grads, final weights."""

    loss_key = "lm loss"  # the reporting key of the stage's loss (a preference stage's: qvl.training.preference)

    def __init__(self, bridge, recording: Recording):
        self.bridge, self.recording = bridge, recording
        self._lr = 0.0

    def on_train_start(self, context) -> None:
        from megatron.core import parallel_state as ps

        self.recording.rank = (
            ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.is_pipeline_last_stage(ignore_virtual=True),
        )
        self.recording.decay = self.export_decay(context.model, decay.megatron_decay(context.optimizer))

    def on_train_step_start(self, context) -> None:
        self._lr = float(context.optimizer.param_groups[0]["lr"])

    def on_train_step_end(self, context) -> None:
        step = context.state.train_state.step + 1  # train_state.step still counts the steps before this one
        value = _mean_loss(context.loss_dict, self.loss_key)
        if value is None:  # only the last pipeline stage holds the reduced loss
            value = float("nan")
        self.recording.steps.append(
            StepRecord(
                step=step,
                loss=value,
                grad_norm=float(context.grad_norm),
                lr=self._lr,
                mtp_loss=_mean_loss(context.loss_dict, MTP_LOSS),
                moe_aux_loss=_load_balancing_loss(context.state.cfg.model),
            )
        )
        if step == 1:
            self.recording.grads = self.export(context.model, grads=True)

    def on_train_end(self, context) -> None:
        self.recording.weights = self.export(context.model, grads=False)

    def export(self, model: list, *, grads: bool) -> dict[str, torch.Tensor]:
        """What is compared: every weight (or its gradient) under HF names."""
        return export_hf(self.bridge, model, grads=grads)

    def export_decay(self, model: list, decay_of: dict[torch.Tensor, float]) -> dict[str, float]:
        """Each compared tensor's weight decay in the built optimizer, exported like the weights."""
        return decay.by_name(export_values(self.bridge, model, decay.as_markers(decay_of)))


class AdapterParityCallback(ParityCallback):
    """ParityCallback on a PEFT run: the initial adapters recorded, gradients and weights of the adapters alone."""

    def __init__(self, bridge: Any, recording: Any, adapters: Any, hf_path: Path):
        super().__init__(bridge, recording)
        self.adapters, self.hf_path = adapters, Path(hf_path)

    def on_train_start(self, context) -> None:
        super().on_train_start(context)
        state = self._state(context.model, lambda p: p.detach().clone())
        self.recording.adapters = AdapterRecord(
            rank=self.adapters.dim,
            alpha=self.adapters.alpha,
            dora=type(self.adapters).__name__ == "QvlDoRA",
            modules=state.modules,
            parameters=state.parameters,
            initial={k: v.float() for k, v in state.tensors.items()},
            shared_a=state.shared_a,
        )

    def export(self, model: list, *, grads: bool) -> dict[str, torch.Tensor]:
        value = (lambda p: _gradient(p).detach().clone()) if grads else (lambda p: p.detach().clone())
        return {k: v.float() for k, v in self._state(model, value).tensors.items()}

    def export_decay(self, model: list, decay_of: dict[torch.Tensor, float]) -> dict[str, float]:
        return decay.by_name(self._state(model, decay.as_markers(decay_of)).tensors)

    def _state(self, model: list, value: Callable[[torch.Tensor], torch.Tensor]):
        from megatron.core.utils import unwrap_model

        from qvl.bridges.adapter_export import peft_state

        return peft_state(self.bridge, unwrap_model(model), self.hf_path, value)


def training_config(run: MegatronRun):
    """The recipe's ConfigContainer for a parity run: the HF checkpoint's weights, no checkpoint written or read."""
    from qvl.training.loop import TrainRequest, prepare_config

    options = {
        # one process unless asked: the recipe's layout is for its published size, not the checkpoint at hand
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "expert_parallel": 1,
        "context_parallel": 1,
        "hf_path": str(run.hf_path),
        "data": str(run.data),
        "train_iters": run.steps,
        "global_batch_size": run.global_batch_size,
        "micro_batch_size": 1,
        "log_interval": 1,
        "save_interval": 10 * run.steps,
        **run.options,
    }
    request = TrainRequest(recipe=run.recipe, overrides=options, run_dir=run.run_dir, device=run.device)
    info, config = prepare_config(request)
    config.checkpoint.save = config.checkpoint.load = config.checkpoint.pretrained_checkpoint = None
    config.logger.tensorboard_dir = None
    config.dataset.num_workers = 0
    return info, config


def start_runtime(device: str) -> None:
    """qvl's CPU runtime where a run trains on the CPU (`device="cpu"` or no CUDA); Megatron-Bridge imported."""
    if device == "cpu" or not torch.cuda.is_available():
        runtime.activate(force=True)
        runtime.enable_bridge_training()
    megatron.import_megatron_bridge()


def run_megatron(run: MegatronRun) -> tuple[Recording, Any]:
    """Train `run.steps` steps with Megatron-Bridge's loop; what it did, and the ConfigContainer it ran."""
    from qvl.bridges.convert import auto_bridge_with_weights

    start_runtime(run.device)
    from qvl.kernels import torch_gated_delta  # Megatron-Core's GatedDeltaNet
    from qvl.training.loop import run_megatron_loop

    _, config = training_config(run)
    bridge = auto_bridge_with_weights(run.hf_path, config.model.params_dtype)
    config.model.register_pre_wrap_hook(lambda chunks: bridge.load_hf_weights(chunks) or chunks)
    # Gated DeltaNet: the delta rule token by token, as the reference runs it (its decay-gate gradients are then
    # within fp32 rounding of exact on both sides; qvl.kernels.torch_gated_delta), unless the run checks a chunked one
    if run.delta_rule == "recurrence":
        config.model.register_pre_wrap_hook(torch_gated_delta.token_by_token)
    adapters = take_adapters(config, run.options)  # a PEFT recipe: its adapters go on after the HF weights
    if adapters is not None:
        config.model.register_pre_wrap_hook(adapter_hook(adapters))
    recording = Recording()
    callbacks = parity_callbacks(bridge, recording, adapters, run.hf_path)
    run_megatron_loop(config, RecordingForwardStep(recording, run.batch_hook), callbacks)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        recording = merge_ranks(recording)
    recording.token_losses = conversation_token_losses(recording.micro_batches)
    return recording, config


def parity_callbacks(bridge, recording: Recording, adapters: Any, hf_path: Path, *, loss_key: str = "lm loss"):
    """Megatron-Bridge callbacks recording a parity run into `recording` (a PEFT recipe's: its adapters alone), the
    stage's loss read under `loss_key`."""
    from megatron.bridge.training.callbacks import CallbackManager

    callback = (
        AdapterParityCallback(bridge, recording, adapters, hf_path) if adapters else ParityCallback(bridge, recording)
    )
    callback.loss_key = loss_key
    callbacks = CallbackManager()
    for event in ("on_train_start", "on_train_step_start", "on_train_step_end", "on_train_end"):
        callbacks.register(event, getattr(callback, event))
    return callbacks


def merge_ranks(recording: Recording) -> Recording:
    """Every rank's recording merged (collective): the micro-batches and losses of each data-parallel replica, in
    step order, from its first tensor-parallel rank of the last pipeline stage; grads and weights are gathered
    already (the export is collective)."""
    for record in recording.micro_batches:  # tensors travel; the loader's other fields stay home
        record.batch = _portable(record.batch)
    ranks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, (recording.rank, recording.micro_batches, recording.steps))
    holders = sorted((rank, batches, steps) for rank, batches, steps in ranks if rank[1] == 0 and rank[2])
    merged = [(r.step, dp, k, r) for (dp, _, _), batches, _ in holders for k, r in enumerate(batches)]
    recording.micro_batches = [r for *_, r in sorted(merged, key=lambda m: m[:3])]
    recording.steps = holders[0][2]
    return recording


def _portable(batch):
    """A PackedBatch reduced to the fields the reference reads (picklable across processes)."""
    fields = ("tokens", "cu_seqlens_q", "image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos")
    return SimpleNamespace(**{f: getattr(batch, f) for f in (*fields, "second_per_grid_ts")})


def conversation_token_losses(micro_batches: list[MicroBatchRecord]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step 1's per-token losses cut at the packs' boundaries: per conversation of L tokens, L predictions (the
    last one would predict the next conversation's first token: learned, it shows as a mask mismatch)."""
    out = []
    for record in micro_batches:
        if record.token_losses is None:
            continue
        cu = record.batch.cu_seqlens_q.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            mask = record.loss_mask[a:b] > 0
            out.append(((record.token_losses[a:b] * mask).cpu(), mask.cpu()))
    return out
