"""The reference side of a preference parity run: TRL's own trainers on the same pairs, unpacked, one per micro-batch.

TRL 1.16's `DPOTrainer` (sigmoid, robust, hinge, IPO; RPO as `loss_type=[loss, "sft"]`) or, for SimPO, its
`trl.experimental.cpo.CPOTrainer` (`loss_type="simpo"`, `cpo_alpha` = qvl's NLL weight, 0 for SimPO itself) trains
transformers' model of the checkpoint: each pair is one micro-batch (TRL's [chosen, rejected] rows) and one optimizer
step accumulates the pairs of one qvl step (`gradient_accumulation_steps`), so the Trainer's mean over micro-batches
is the mean over the step's pairs, as qvl's step takes it. The reference model is TRL's: a second copy of the
checkpoint (full fine-tuning) or the same model with its adapters disabled (peft LoRA, from qvl's initial adapters);
its log-probs are TRL's own (`compute_ref_log_probs`), not qvl's precomputed table. Nothing of qvl's loss code runs
here: the settings are translated into TRL's options (`trl_loss`); each pair's loss is what TRL's `compute_loss`
returns, its log-probs the policy's per-token log-probs (transformers' output) summed over the completion, and each
step's rewards TRL's own log (`rewards/*`, logged every step).

CPOTrainer's forward is text-only (input ids and attention mask): the pair's pixels and grids are added to the call
its `concatenated_forward` makes, and nothing else of it changes. TRL's own MoE load-balancing loss (transformers'
definition) is off; where qvl's run adds Megatron-Core's, weighed per pair as qvl weighs it
(qvl.kernels.fix_preference_moe_aux), this side adds the same on transformers' routers (`PairMoeAux`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qvl.foundation.errors import ConfigError
from qvl.training.parity import decay
from qvl.training.parity.adapters import adapter_names, load_adapters, lora_config_of
from qvl.training.parity.decay import megatron_no_decay
from qvl.training.parity.exact import recurrent_reference
from qvl.training.parity.megatron_run import Recording, StepRecord
from qvl.training.parity.moe_aux import MoeAuxReference
from qvl.training.parity.preference_pairs import (
    SIDES,
    PairInputs,
    PairRecord,
    Scores,
    cpo_batch,
    dpo_batch,
    side_token_losses,
)
from qvl.training.parity.transformers_run import (
    ReferenceConfig,
    _single_process,
    checkpoint_names,
    decay_rules_differ,
    items_per_step,
    training_arguments,
)

logger = logging.getLogger(__name__)
TRL_VERSION = "1.16.0"  # the TRL this side is written against; pyproject's `verify` extra pins it (a test keeps both)
# TRL's step metrics (the mean over the step's micro-batches: its pairs), as qvl's report names them
REWARD_KEYS = {"reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected",
               "reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins"}  # fmt: skip


def require_trl() -> None:
    """Refuse, before anything trains, a machine without the TRL this check is written against."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("trl")
    except PackageNotFoundError:
        found = None
    if found != TRL_VERSION:
        have = f"trl {found} is installed" if found else "trl is not installed"
        raise ConfigError(
            f"verifying a preference recipe trains TRL {TRL_VERSION}'s trainers as the reference, and {have}; "
            "install it with `pip install -e '.[verify]'` (or `pip install trl==" + TRL_VERSION + "`)"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class TrlLoss:
    """A qvl preference loss as TRL 1.16 spells it: which trainer, and its config's loss fields."""

    trainer: str  # "dpo" (DPOTrainer) or "cpo" (CPOTrainer)
    fields: dict


def trl_loss(settings: Any) -> TrlLoss:
    """TRL's trainer and loss fields for qvl's preference settings (qvl.recipes.preference.PreferenceConfig); refuses
    what TRL 1.16 has no loss for, naming the option that has one."""
    loss, s, mean = settings.loss, settings.label_smoothing, settings.logp == "mean"
    if loss == "simpo":
        fields = dict(loss_type="simpo", simpo_gamma=settings.simpo_gamma, cpo_alpha=settings.nll_weight)
        return TrlLoss(trainer="cpo", fields=dict(fields, beta=settings.beta, label_smoothing=s))
    if loss == "sigmoid" and s:
        raise ConfigError(
            f"dpo_label_smoothing={s}: TRL 1.16's DPOTrainer 'sigmoid' has no label smoothing (only 'robust' has one); "
            "verify with dpo_label_smoothing=0 or dpo_loss=robust"
        )
    if mean and loss != "sigmoid":
        raise ConfigError(
            f"dpo_logp=mean with dpo_loss={loss}: TRL 1.16 length-normalises only 'sigmoid' ('sigmoid_norm') and "
            "'ipo' (always); verify with dpo_logp=sum"
        )
    types = ["sigmoid_norm" if mean else loss]
    weights = [1.0]
    if settings.nll_weight:  # RPO: TRL's "sft" term, the chosen completion's mean token NLL
        types, weights = types + ["sft"], weights + [settings.nll_weight]
    return TrlLoss(
        trainer="dpo", fields=dict(beta=settings.beta, loss_type=types, loss_weights=weights, label_smoothing=s)
    )


@dataclass(kw_only=True, slots=True)
class PairMoeAux(MoeAuxReference):
    """Megatron-Core's load-balancing loss on transformers' routers, weighed per pair as qvl's preference step
    weighs it: pack m of T_m tokens and p_m pairs adds p_m x aux(m) to the step's summed pair losses, aux(m) the
    router's loss over the pack's tokens; pair j of it takes the share its tokens' router probabilities carry. Only
    grad-enabled forwards (the policy's) and the counting pass are read: TRL's reference forward under adapters
    disabled runs the same routers."""

    counting: bool = False

    def _hook(self, index: int):
        def keep(module, args, output):
            if self.counting or torch.is_grad_enabled():
                self.logits[index], self.chosen[index] = output[0], output[2]

        return keep

    def count_pairs(self, model: torch.nn.Module, pairs: list[PairInputs]) -> None:
        """Each pack's top-k counts per router from its sides, unpadded, at the step's starting weights."""
        sides = [getattr(pair, side) for pair in pairs for side in SIDES]
        slots = [pair.slot for pair in pairs for _ in SIDES]
        self.counting = True
        try:  # dataclass(slots=True) rebuilds the class: the base method by name
            MoeAuxReference.count_step(self, model, [_model_inputs(side) for side in sides], slots)
        finally:
            self.counting = False

    def pair_term(self, pair: PairInputs, attention_mask: torch.Tensor) -> torch.Tensor:
        """The pair's term from its forward just run (rows where `attention_mask` is 1: its two sides' tokens)."""
        rows = attention_mask.reshape(-1).bool()
        scale = self.coeff * self.num_experts * pair.pack_pairs / (self.topk * pair.slot.tokens**2)
        total = 0.0
        for logits, counts in zip(self.logits, self.tokens_per_expert(pair.slot.pack), strict=True):
            probs = torch.softmax(logits.float().reshape(-1, self.num_experts)[rows.to(logits.device)], dim=-1)
            total = total + (probs.sum(0) * counts.to(probs.device)).sum()
        return scale * total

    def pair_logged(self, term: torch.Tensor, pair: PairInputs) -> float:
        """The pair's share of the loss the routers add for its pack, as qvl's side reads it (moe_aux.logged)."""
        return self.logged(term, pair.slot, pair.slot.tokens / pair.pack_pairs)


def _model_inputs(side: dict) -> dict:
    return {k: v for k, v in side.items() if k not in ("labels", "completion_mask")}


@dataclass(kw_only=True, slots=True)
class _Record:
    scores: Scores = field(default_factory=lambda: Scores(pairs=[], rewards=[]))
    losses: dict[int, list[float]] = field(default_factory=dict)  # step -> each pair's loss
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    token_losses: list[tuple[tuple, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # (place, ...)
    moe_aux: dict[int, float] = field(default_factory=dict)


class _PairRecorder:
    """What both recording trainers add to TRL's: Megatron's decay rule (unless asked for the Trainer's), each pair's
    loss, log-probs (summed from the policy's per-token log-probs over the completion) and TRL's reference log-probs,
    step 1's per-token log-probs, and Megatron-Core's load-balancing term where qvl's run added it."""

    def __init__(self, *args, record: _Record, pairs: list[PairInputs], aux: PairMoeAux | None, megatron_decay: bool,
                 **kwargs):  # fmt: skip
        self.record, self.pairs, self.aux, self.seen, self.policy_output = record, pairs, aux, 0, None
        self.megatron_decay = megatron_decay
        super().__init__(*args, **kwargs)
        self.add_callback(_step_recorder_class()(record))

    def get_decay_parameter_names(self, model) -> list[str]:
        if not self.megatron_decay:
            return super().get_decay_parameter_names(model)
        return [n for n, p in model.named_parameters() if not megatron_no_decay(n, p)]

    def keep_policy_output(self, module, args, kwargs, output) -> None:
        """Forward hook on transformers' model: the policy's output (the grad-enabled forward) of this pair."""
        if torch.is_grad_enabled():
            self.policy_output = output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        index, self.seen = self.seen, self.seen + 1
        pair, step = self.pairs[index], self.state.global_step + 1
        if self.aux is not None and index % self.args.gradient_accumulation_steps == 0:
            self.aux.count_pairs(model, self.pairs[index : index + self.args.gradient_accumulation_steps])
        reference = self.reference_logps(inputs)
        loss = super().compute_loss(model, inputs, False, num_items_in_batch)
        self.record.losses.setdefault(step, []).append(float(loss.detach()))
        if self.aux is not None:
            term = self.aux.pair_term(pair, self.attention_mask(inputs))
            loss = loss + term
            self.record.moe_aux[step] = self.record.moe_aux.get(step, 0.0) + self.aux.pair_logged(term, pair)
        sides = self.side_token_losses(pair, inputs)
        self.record.scores.pairs.append(
            PairRecord(
                step=step,
                loss=self.record.losses[step][-1],
                logp_chosen=-float(sides[0][1][0].sum()),
                logp_rejected=-float(sides[1][1][0].sum()),
                ref_logp_chosen=None if reference is None else float(reference[0]),
                ref_logp_rejected=None if reference is None else float(reference[1]),
            )
        )
        if step == 1:
            self.record.token_losses += sides
        return loss

    def side_token_losses(self, pair: PairInputs, inputs: dict) -> list:
        """Each side's (place in qvl's run, (per-position loss, learned)) from the policy's output of this pair."""
        logps = self.token_logps(self.policy_output, inputs)
        out = []
        for row, side in enumerate(SIDES):
            length = int(getattr(pair, side)["input_ids"].shape[1])
            completion = getattr(pair, side)["completion_mask"][0]
            out.append(((pair.place[0], pair.place[1 + row]), side_token_losses(logps[row], completion, length)))
        return out


def _step_recorder_class():
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Each step's learning rate, gradient norm and TRL's rewards (from its log, every step), and step 1's
        gradients after clipping, as Megatron's are recorded."""

        def __init__(self, record: _Record):
            self.record = record

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.record.lrs.append(float(optimizer.param_groups[0]["lr"]))
            if state.global_step == 0:
                self.record.grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()
                                     if p.grad is not None}  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                self.record.grad_norms.append(float(logs["grad_norm"]))
                self.record.scores.rewards.append({name: float(logs[key]) for name, key in REWARD_KEYS.items()})

    return StepRecorder


def _dpo_class():
    from trl import DPOTrainer

    class RecordingDPOTrainer(_PairRecorder, DPOTrainer):
        """TRL's DPOTrainer, recording what it does."""

        def reference_logps(self, inputs: dict) -> torch.Tensor:
            """TRL's reference log-probs of the pair (its own method: the reference model, or adapters disabled)."""
            chosen, rejected = self.compute_ref_log_probs(self.ref_model or self.model, inputs)
            return torch.cat([chosen, rejected]).detach()

        def attention_mask(self, inputs: dict) -> torch.Tensor:
            return inputs["attention_mask"]

        def token_logps(self, output, inputs: dict) -> torch.Tensor:
            return output.log_probs  # TRL's fused head: per position, the next token's log-prob [2, L - 1]

    return RecordingDPOTrainer


def _cpo_class():
    from trl.experimental.cpo import CPOTrainer

    class RecordingCPOTrainer(_PairRecorder, CPOTrainer):
        """TRL's CPOTrainer, recording what it does, its forward given the pair's pixels."""

        def reference_logps(self, inputs: dict) -> None:
            return None  # SimPO is reference-free

        def concatenated_forward(self, model, batch):
            self.vision = {k: v for k, v in batch.items() if not k.startswith(SIDES)}
            return super().concatenated_forward(_WithVision(model, self), batch)

        def attention_mask(self, inputs: dict) -> torch.Tensor:
            return self.vision_mask

        def token_logps(self, output, inputs: dict) -> torch.Tensor:
            labels = self.vision_ids[:, 1:]
            logps = torch.log_softmax(output.logits[:, :-1].float(), dim=-1)
            return logps.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    return RecordingCPOTrainer


class _WithVision:
    """The model as CPOTrainer calls it (ids and attention mask), with the pair's pixels, grids and token types."""

    def __init__(self, model, trainer):
        self.model, self.trainer = model, trainer

    def __call__(self, input_ids, attention_mask=None, **kwargs):
        config = self.trainer.model.config
        kinds = (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()
        self.trainer.vision_mask, self.trainer.vision_ids = attention_mask, input_ids
        return self.model(input_ids, attention_mask=attention_mask, mm_token_type_ids=kinds, **self.trainer.vision,
                          **kwargs)  # fmt: skip


def reference_model(hf_path: Path):
    """transformers' model of the checkpoint in fp32, its Gated DeltaNet (if any) the token-by-token recurrence."""
    from transformers import AutoModelForImageTextToText

    return recurrent_reference(AutoModelForImageTextToText.from_pretrained(str(hf_path), dtype=torch.float32))


def run_trl(
    hf_path: Path,
    steps: list[list[PairInputs]],
    settings: ReferenceConfig,
    loss: TrlLoss,
    output_dir: Path,
    *,
    adapters=None,
    moe_aux: tuple[str, float] | None = None,
) -> tuple[Recording, Scores]:
    """Train `steps` (each the pairs of one qvl step) with TRL; what it did, and what it scored."""
    accumulation = items_per_step(steps, "pairs", "TRL")
    with _single_process(), _without_telemetry():
        trainer, record = _trainer(hf_path, [p for step in steps for p in step], settings, loss, output_dir,
                                   accumulation, adapters=adapters, moe_aux=moe_aux)  # fmt: skip
        trainer.train()
    return _recording(trainer, record, adapters), record.scores


@contextlib.contextmanager
def _without_telemetry():
    """TRL's trainers report their use to the Hugging Face Hub when built (huggingface_hub's telemetry); a local
    check sends nothing, unless the user's environment already decided (HF_HUB_DISABLE_TELEMETRY)."""
    saved = os.environ.get("HF_HUB_DISABLE_TELEMETRY")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_DISABLE_TELEMETRY", None)


def _trainer(hf_path, pairs, settings, loss, output_dir, accumulation, *, adapters, moe_aux):
    """TRL's trainer for `loss` on `pairs` (one a micro-batch) with the recipe's optimizer and schedule, logging
    every step (its rewards), started from qvl's initial adapters where it trains some."""
    from datasets import Dataset
    from transformers import AutoProcessor, PrinterCallback

    processor = AutoProcessor.from_pretrained(str(hf_path))
    tokenizer = processor.tokenizer
    model = reference_model(hf_path)
    base = training_arguments(settings, accumulation, output_dir, cpu=not torch.cuda.is_available(), bf16=False)
    common = {f.name: getattr(base, f.name) for f in dataclasses.fields(type(base)) if f.init}
    common |= {"logging_strategy": "steps", "logging_steps": 1, **loss.fields}
    aux = None if moe_aux is None else PairMoeAux.attach(model, kind=moe_aux[0], coeff=moe_aux[1])
    record = _Record()
    extras = dict(record=record, pairs=pairs, aux=aux, megatron_decay=settings.weight_decay_rule == "megatron",
                  peft_config=None if adapters is None else lora_config_of(adapters))  # fmt: skip
    if loss.trainer == "dpo":
        from trl import DPOConfig

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batches = [dpo_batch(pair, pad) for pair in pairs]
        rows = [{"pair": i, "images": []} for i in range(len(pairs))]  # "images": TRL's vision-dataset path
        trainer = _dpo_class()(
            model=model, ref_model=None if adapters is not None else reference_model(hf_path),
            args=DPOConfig(**common, max_length=None, router_aux_loss_coef=0.0), train_dataset=Dataset.from_list(rows),
            data_collator=lambda features: batches[features[0]["pair"]], processing_class=processor, **extras,
        )  # fmt: skip
    else:
        from trl.experimental.cpo import CPOConfig

        batches = [cpo_batch(pair) for pair in pairs]
        rows = [{"pair": i, **_texts(pair, tokenizer)} for i, pair in enumerate(pairs)]
        trainer = _cpo_class()(
            model=model, args=CPOConfig(**common, max_length=None), train_dataset=Dataset.from_list(rows),
            data_collator=lambda features: batches[features[0]["pair"]], processing_class=tokenizer, **extras,
        )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the log of every step is read, not printed
    if adapters is not None:
        load_adapters(trainer.model, adapters)  # before train(): the optimizer is built on the tied A's
    model.register_forward_hook(trainer.keep_policy_output, with_kwargs=True)
    return trainer, record


def _texts(pair: PairInputs, tokenizer) -> dict:
    """The pair as text, which CPOTrainer tokenizes on its own at init (its batches are the collator's)."""
    ids, completion = pair.chosen["input_ids"][0], pair.chosen["completion_mask"][0]
    first = int(completion.nonzero()[0])
    out = {"prompt": tokenizer.decode(ids[:first])}
    for side in SIDES:
        side_ids, side_mask = getattr(pair, side)["input_ids"][0], getattr(pair, side)["completion_mask"][0]
        out[side] = tokenizer.decode(side_ids[side_mask.bool()])
    return out


def _recording(trainer, record: _Record, adapters) -> Recording:
    names = checkpoint_names if adapters is None else lambda _, tensors: adapter_names(tensors, adapters)
    recording = Recording(grads=names(trainer.model, record.grads))
    state = {n: t.detach().clone().float().cpu() for n, t in trainer.model.state_dict().items()}
    recording.weights = names(trainer.model, state)
    recording.steps = [
        StepRecord(step=s, loss=sum(losses) / len(losses), grad_norm=norm, lr=lr, moe_aux_loss=record.moe_aux.get(s))
        for (s, losses), norm, lr in zip(sorted(record.losses.items()), record.grad_norms, record.lrs)
    ]
    recording.decay_rules_differ = decay_rules_differ(trainer)
    markers = decay.as_markers(decay.torch_decay(trainer.optimizer))
    params = trainer.model.named_parameters(remove_duplicate=False)
    recording.decay = decay.by_name(names(trainer.model, {n: markers(p) for n, p in params}))
    recording.token_losses = [losses for _, losses in sorted(record.token_losses, key=lambda item: item[0])]
    return recording
