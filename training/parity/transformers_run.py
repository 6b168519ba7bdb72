"""The reference side of a parity run: the same samples, unpacked, trained by transformers' own `Trainer`.

Each packed micro-batch qvl's loop consumed is cut back into its conversations (tokens, pixels and grids of each),
and every conversation is one Trainer micro-batch of batch size 1: one optimizer step accumulates the conversations
of one Megatron global batch (`gradient_accumulation_steps`), and the Trainer normalises the loss by the learned
tokens of the whole step (`num_items_in_batch`), as transformers does by default. The labels are the HF
convention, built here from the token ids alone, independently of qvl's loss mask: an assistant turn's content and
its closing `<|im_end|>` are learned, nothing else. The optimizer, schedule, clipping and weight-decay groups are
the recipe's, set through TrainingArguments (`reference_settings`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from qvl.foundation.errors import ConfigError, DataError
from qvl.training.parity import decay
from qvl.training.parity.decay import megatron_no_decay
from qvl.training.parity.megatron_run import Recording, StepRecord
from qvl.training.parity.moe_aux import MoeAuxReference, PackSlot
from qvl.training.parity.mtp import OutputsWithMtp, mtp_token_loss_sum, named_as_checkpoint, with_mtp_head

logger = logging.getLogger(__name__)
IGNORE = -100  # transformers' label for "not learned"
# Megatron-Bridge's LR decay style -> transformers' scheduler with the same shape (both start warmup from 0).
SCHEDULES = {"cosine": "cosine_with_min_lr", "constant": "constant_with_warmup"}


@dataclass(kw_only=True, slots=True)
class ReferenceConfig:
    """The recipe's optimizer, schedule and clipping, as transformers' TrainingArguments will get them."""

    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    schedule: str
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip: float
    weight_decay_rule: str = "megatron"  # "megatron": no decay on 1-D tensors and biases; "transformers": Trainer's
    # "token": every learned token of a step weighs the same (the recipe's calculate_per_token_loss); "conversation":
    # what Trainer does for Qwen-VL in transformers 5.12 (accepts_loss_kwargs=False): each conversation's mean
    # loss, averaged over the conversations of a step
    loss_average: str = "token"


def reference_settings(config, *, weight_decay_rule: str = "megatron", loss_average: str = "token") -> ReferenceConfig:
    """What a Megatron-Bridge ConfigContainer's optimizer and scheduler do, for the Trainer."""
    optimizer, scheduler = config.optimizer, config.scheduler
    if scheduler.lr_decay_style not in SCHEDULES:
        raise ConfigError(
            f"lr_decay_style={scheduler.lr_decay_style!r} has no transformers schedule of the same shape here; "
            f"verify with lr_decay_style={' or '.join(SCHEDULES)}"
        )
    if scheduler.lr_warmup_init or scheduler.start_weight_decay != scheduler.end_weight_decay:
        raise ConfigError(
            "the reference schedule warms up from 0 at a constant weight decay; set scheduler.lr_warmup_init=0 "
            "and start_weight_decay=end_weight_decay"
        )
    warmup = scheduler.lr_warmup_steps / config.train.global_batch_size  # in samples once the config is validated
    if warmup != int(warmup):
        raise ConfigError(
            f"Megatron-Bridge capped the warm-up to {scheduler.lr_warmup_steps} samples ({warmup:.2f} steps), which "
            "transformers' schedulers cannot express; pass warmup_iters=N with N smaller than the steps verified"
        )
    return ReferenceConfig(
        steps=config.train.train_iters,
        lr=optimizer.lr,
        min_lr=optimizer.min_lr or 0.0,
        warmup_steps=int(warmup),
        schedule=SCHEDULES[scheduler.lr_decay_style],
        weight_decay=optimizer.weight_decay,
        betas=(optimizer.adam_beta1, optimizer.adam_beta2),
        eps=optimizer.adam_eps,
        clip=optimizer.clip_grad,
        weight_decay_rule=weight_decay_rule,
        loss_average=loss_average,
    )


def assistant_labels(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """HF labels for one conversation: assistant content and its `<|im_end|>` learned, the rest IGNORE."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    ids_list = ids.tolist()
    labels = torch.full_like(ids, IGNORE)
    for i, token in enumerate(ids_list):
        if token == start and ids_list[i + 1 : i + 1 + len(header)] == header:
            first = i + 1 + len(header)
            last = ids_list.index(end, first) if end in ids_list[first:] else len(ids_list) - 1
            labels[first : last + 1] = ids[first : last + 1]
    return labels


@dataclass(kw_only=True, slots=True)
class _Media:
    """Which rows of a pack's pixels and which grids belong to each of its conversations."""

    token_id: int
    grids: torch.Tensor  # [n, 3]
    pixels: torch.Tensor | None
    merge: int
    taken: int = 0  # grids handed out so far
    row: int = 0

    def take(self, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, int, int]:
        """(pixels, grids, first grid, end grid) for the placeholders among `tokens` (grids in token order)."""
        placeholders, first = int((tokens == self.token_id).sum()), self.taken
        while placeholders > 0:
            placeholders -= int(self.grids[self.taken].prod()) // self.merge**2
            self.taken += 1
        if placeholders:
            raise DataError(
                f"a conversation's {self.token_id} placeholders end inside grid {self.taken - 1} "
                f"({self.grids[self.taken - 1].tolist()}); the pack's grids and tokens disagree: re-prepare the data"
            )
        rows = int(self.grids[first : self.taken].prod(-1).sum())
        pixels = None if rows == 0 else self.pixels[self.row : self.row + rows]
        self.row += rows
        return pixels, self.grids[first : self.taken], first, self.taken


def unpack(batch, hf_config, tokenizer, *, seconds_per_grid: bool) -> list[dict]:
    """The conversations of a packed batch as HF model inputs, one dict (batch size 1) each."""
    cu = batch.cu_seqlens_q.tolist()
    merge = hf_config.vision_config.spatial_merge_size
    images = _Media(
        token_id=hf_config.image_token_id, grids=batch.image_grid_thw, pixels=batch.pixel_values, merge=merge
    )
    videos = _Media(
        token_id=hf_config.video_token_id, grids=batch.video_grid_thw, pixels=batch.pixel_values_videos, merge=merge
    )
    samples = []
    for a, b in zip(cu[:-1], cu[1:]):
        ids = batch.tokens[0, a:b].clone()
        kinds = torch.zeros_like(ids)
        kinds[ids == hf_config.image_token_id], kinds[ids == hf_config.video_token_id] = 1, 2
        sample = {
            "input_ids": ids[None],
            "attention_mask": torch.ones_like(ids)[None],
            "mm_token_type_ids": kinds[None],
            "labels": assistant_labels(ids, tokenizer)[None],
        }
        pixels, grids, _, _ = images.take(ids)
        if pixels is not None:
            sample |= {"pixel_values": pixels, "image_grid_thw": grids}
        pixels, grids, first, end = videos.take(ids)
        if pixels is not None:
            sample |= {"pixel_values_videos": pixels, "video_grid_thw": grids}
            if seconds_per_grid:
                sample["second_per_grid_ts"] = batch.second_per_grid_ts[first:end]
        samples.append(sample)
    return samples


@dataclass(kw_only=True, slots=True)
class _TrainerRecord:
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    token_losses: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # step 1: (losses, mask)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    mtp: dict[int, list] = field(default_factory=dict)  # step -> [sum of the MTP token losses, their count]
    moe_aux: dict[int, float] = field(default_factory=dict)  # step -> the load-balancing loss, coefficient included


def _trainer_class():
    from transformers import Trainer, TrainerCallback

    class ReferenceTrainer(Trainer):
        """transformers' Trainer, recording what it does; only the weight-decay rule may be Megatron's."""

        def __init__(
            self, *args, record: _TrainerRecord, no_decay=None, mtp_scale: float = 0.0, moe_aux=None, slots=None,
            **kwargs,
        ):  # fmt: skip
            self.record, self.no_decay, self.mtp_scale = record, no_decay, mtp_scale
            self.moe_aux, self.slots, self.seen = moe_aux, slots, 0  # Megatron's load-balancing loss, if on
            super().__init__(*args, **kwargs)
            self.add_callback(_GradientRecorder(record))

        def get_decay_parameter_names(self, model) -> list[str]:
            if self.no_decay is None:
                return super().get_decay_parameter_names(model)
            return [n for n, p in model.named_parameters() if not self.no_decay(n, p)]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            all_labels = inputs["labels"]  # read first: with a compute_loss_func the Trainer pops them
            labels = all_labels[0, 1:]
            index, self.seen = self.seen, self.seen + 1  # the conversation's place in the (sequential) dataset
            if self.moe_aux is not None and index % self.args.gradient_accumulation_steps == 0:
                step = slice(index, index + self.args.gradient_accumulation_steps)
                self.moe_aux.count_step(model, self.train_dataset[step], self.slots[step])
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            step = self.state.global_step + 1
            # per conversation, the Trainer divides by the accumulation steps after this (training_step)
            share = 1 if self.compute_loss_func else self.current_gradient_accumulation_steps
            self.record.losses[step] = self.record.losses.get(step, 0.0) + float(loss.detach()) / share
            if isinstance(outputs, OutputsWithMtp):  # qvl.training.mtp's loss: over the step's main learned tokens
                mtp_sum, mtp_tokens = mtp_token_loss_sum(outputs.mtp_logits, all_labels, all_labels != IGNORE)
                loss = loss + self.mtp_scale * mtp_sum / num_items_in_batch
                total = self.record.mtp.setdefault(step, [0.0, 0])
                total[0], total[1] = total[0] + float(mtp_sum.detach()), total[1] + mtp_tokens
            if self.moe_aux is not None:
                term = self.moe_aux.term(self.slots[index], num_items_in_batch)
                loss = loss + term
                logged = self.moe_aux.logged(term, self.slots[index], num_items_in_batch)
                self.record.moe_aux[step] = self.record.moe_aux.get(step, 0.0) + logged
            if step == 1:
                ce = torch.nn.functional.cross_entropy(
                    outputs.logits[0, :-1].float(), labels.clamp(min=0), reduction="none"
                )
                mask = labels != IGNORE
                # the last position predicts nothing here: a zero, unlearned entry keeps both sides L long
                losses, mask = torch.cat([(ce * mask).detach(), ce.new_zeros(1)]), torch.cat([mask, mask.new_zeros(1)])
                self.record.token_losses.append((losses.cpu(), mask.cpu()))
            return (loss, outputs) if return_outputs else loss

        def _clip_grad_norm(self, model):
            norm = super()._clip_grad_norm(model)
            self.record.grad_norms.append(float(norm))
            return norm

    class _GradientRecorder(TrainerCallback):
        def __init__(self, record: _TrainerRecord):
            self.record = record

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.record.lrs.append(float(optimizer.param_groups[0]["lr"]))
            if state.global_step == 0:  # after clipping, as Megatron's recorded gradients are
                self.record.grads = {
                    n: p.grad.detach().clone().float().cpu() for n, p in model.named_parameters() if p.grad is not None
                }

    return ReferenceTrainer


def training_arguments(settings: ReferenceConfig, accumulation: int, output_dir: Path, *, cpu: bool, bf16: bool):
    """TrainingArguments with the recipe's optimizer, schedule and clipping, one conversation per micro-batch."""
    from transformers import TrainingArguments

    kwargs = {"min_lr": settings.min_lr} if settings.schedule == "cosine_with_min_lr" else {}
    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulation,
        max_steps=settings.steps,
        learning_rate=settings.lr,
        lr_scheduler_type=settings.schedule,
        lr_scheduler_kwargs=kwargs,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_epsilon=settings.eps,
        max_grad_norm=settings.clip,
        optim="adamw_torch",
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=cpu,
        bf16=bf16,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def pack_slots(recording: Recording) -> list[list[PackSlot]]:
    """For each optimizer step, where each of its conversations (in `samples_per_step` order) sat: its pack's index
    in the step and the pack's token count."""
    steps: dict[int, list[PackSlot]] = {}
    packs: dict[int, int] = {}
    for record in recording.micro_batches:
        pack = packs[record.step] = packs.get(record.step, -1) + 1
        slot = PackSlot(pack=pack, tokens=int(record.batch.tokens.shape[1]))
        steps.setdefault(record.step, []).extend([slot] * (len(record.batch.cu_seqlens_q) - 1))
    return [steps[s] for s in sorted(steps)]


def samples_per_step(recording: Recording, hf_config, tokenizer, *, seconds_per_grid: bool) -> list[list[dict]]:
    """For each optimizer step of qvl's run, its conversations unpacked, in the order the loop consumed them."""
    steps: dict[int, list[dict]] = {}
    for record in recording.micro_batches:
        steps.setdefault(record.step, []).extend(
            unpack(record.batch, hf_config, tokenizer, seconds_per_grid=seconds_per_grid)
        )
    return [steps[s] for s in sorted(steps)]


def run_transformers(
    hf_path: Path,
    steps: list[list[dict]],
    settings: ReferenceConfig,
    output_dir: Path,
    *,
    bf16: bool = False,
    adapters=None,
    mtp_scale: float = 0.0,
    moe_aux: tuple[str, float] | None = None,
    slots: list[list[PackSlot]] | None = None,
) -> Recording:
    """Train the HF model on `steps` (each a list of conversations) with transformers' Trainer; what it did.
    With `adapters` (qvl.training.parity.adapters.AdapterRecord) the model is wrapped by peft with them first; with
    `mtp_scale` > 0 the checkpoint's MTP head trains beside it at that loss scale (qvl.training.parity.mtp); with
    `moe_aux` (Megatron's load-balancing type and coefficient) and each conversation's pack `slots`, Megatron-Core's
    load-balancing loss is added on transformers' routers (qvl.training.parity.moe_aux)."""
    accumulation = items_per_step(steps, "conversations", "transformers")
    with _single_process():
        return _train_reference(
            hf_path,
            steps,
            settings,
            output_dir,
            bf16=bf16,
            accumulation=accumulation,
            adapters=adapters,
            mtp_scale=mtp_scale,
            moe_aux=moe_aux,
            slots=[slot for step in slots for slot in step] if slots else None,
        )


def items_per_step(steps: list[list], items: str, reference: str) -> int:
    """The number of `items` (conversations, pairs) every step of the qvl run held: the reference accumulates a
    fixed number per optimizer step."""
    counts = {len(s) for s in steps}
    if len(counts) != 1:
        raise ConfigError(
            f"the steps of the qvl run held {sorted(counts)} {items}; {reference} accumulates a fixed number per step, "
            f"so verify on a dataset whose global batch is all of it (a handful of {items})"
        )
    return counts.pop()


@contextlib.contextmanager
def _single_process():
    """The reference is one process even inside qvl's multi-rank run: accelerate (under the Trainer) reads the
    launcher's environment to decide on DDP, so the rank variables are hidden while it trains."""
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


def _train_reference(
    hf_path, steps, settings, output_dir, *, bf16: bool, accumulation: int, adapters=None, mtp_scale=0.0, moe_aux=None,
    slots=None,
) -> Recording:  # fmt: skip
    from transformers import AutoModelForImageTextToText

    from qvl.training.parity.adapters import adapter_names, reference_model
    from qvl.training.parity.exact import recurrent_reference

    cpu = not torch.cuda.is_available()
    # fp32 weights in both precisions: bf16 is autocast, as Megatron's bf16-mixed keeps fp32 main weights
    model = AutoModelForImageTextToText.from_pretrained(str(hf_path), dtype=torch.float32)
    model = recurrent_reference(model)  # Gated DeltaNet: the token-by-token delta rule, as qvl's side runs it
    loss_config = model.config
    if adapters is not None:
        model = reference_model(model, adapters)
    if mtp_scale:
        model = with_mtp_head(model, hf_path)
    aux = None if moe_aux is None else MoeAuxReference.attach(model, kind=moe_aux[0], coeff=moe_aux[1])
    record = _TrainerRecord()
    no_decay = megatron_no_decay if settings.weight_decay_rule == "megatron" else None
    trainer = _trainer_class()(
        model=model,
        compute_loss_func=_per_token_loss(loss_config) if settings.loss_average == "token" else None,
        args=training_arguments(settings, accumulation, output_dir, cpu=cpu, bf16=bf16),
        train_dataset=[sample for step in steps for sample in step],
        data_collator=lambda features: features[0],
        record=record,
        no_decay=no_decay,
        mtp_scale=mtp_scale,
        moe_aux=aux,
        slots=slots,
    )
    trainer.train()
    names = checkpoint_names if adapters is None else lambda _, tensors: adapter_names(tensors, adapters)
    if mtp_scale:
        names = partial(named_as_checkpoint, main_names=names)
    recording = Recording(grads=names(trainer.model, record.grads))
    recording.weights = names(
        trainer.model, {n: t.detach().clone().float().cpu() for n, t in trainer.model.state_dict().items()}
    )
    recording.steps = [
        StepRecord(
            step=s,
            loss=record.losses[s],
            grad_norm=norm,
            lr=lr,
            mtp_loss=_mean(record.mtp.get(s)),
            moe_aux_loss=record.moe_aux.get(s),
        )  # fmt: skip
        for s, norm, lr in zip(sorted(record.losses), record.grad_norms, record.lrs)
    ]
    recording.decay_rules_differ = decay_rules_differ(trainer)
    # the decay of every tensor as the Trainer's optimizer holds it, named as the weights are
    markers = decay.as_markers(decay.torch_decay(trainer.optimizer))
    params = trainer.model.named_parameters(remove_duplicate=False)
    recording.decay = decay.by_name(names(trainer.model, {n: markers(p) for n, p in params}))
    recording.token_losses = record.token_losses
    return recording


def _mean(total: list | None) -> float | None:
    return None if total is None else total[0] / max(total[1], 1)


def decay_rules_differ(trainer) -> list[str]:
    """The parameters transformers' own Trainer rule decays and Megatron's does not, or the other way round."""
    from transformers import Trainer

    decayed = set(Trainer.get_decay_parameter_names(trainer, trainer.model))
    trained = ((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)  # frozen ones never move
    # named as in the HF model (an MTP run wraps it: qvl.training.parity.mtp)
    return sorted(n.removeprefix("main.") for n, p in trained if (n in decayed) == megatron_no_decay(n, p))


def _per_token_loss(config):
    """transformers' own causal-LM loss, summed and divided by the step's learned tokens (`num_items_in_batch`)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab = config.get_text_config().vocab_size
    return lambda outputs, labels, num_items_in_batch: ForCausalLMLoss(
        outputs.logits, labels, vocab, num_items_in_batch=num_items_in_batch
    )


def checkpoint_names(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module names -> the names (and layouts) `save_pretrained` writes, which the bridge's export uses too."""
    from transformers.core_model_loading import revert_weight_conversion

    return {name: tensor.float() for name, tensor in revert_weight_conversion(model, dict(tensors)).items()}
