"""The reference side of a parity run with multi-token prediction (MTP): transformers' Qwen3.5 model and the
published MTP head (qvl.bridges.mtp_reference) trained together by the Trainer, as qvl's recipe trains its
Megatron-Core MTP block.

transformers builds no MTP module, so `WithMtpHead` holds the HF model and the checkpoint's head side by side and
returns both heads' logits. The loss the Trainer minimises is then what qvl's step minimises (qvl.training.mtp):

    (sum of the main head's token losses + scale x sum of the MTP token losses) / the step's main learned tokens

with the MTP target of position i the token at i + 2 of the same conversation, learned where that token is learned
(HF labels), and `scale` the recipe's `mtp_loss_scaling_factor` / MTP layers. Where token i + 1 is an image or video
placeholder the head reads its vision features, as vLLM serves it and qvl's MTP layer trains it
(qvl.bridges.mtp_inputs), so the MTP loss's gradient reaches the vision tower on both sides. Gradients and final weights of the
head are compared under the checkpoint's `mtp.*` names, as qvl's bridge exports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qvl.bridges.mtp_reference import (
    MTP_PREFIX,
    checkpoint_mtp_names,
    load_mtp_head,
    logits_with_mtp,
    to_disk_layout,
)

_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


@dataclass(kw_only=True, slots=True, frozen=True)
class OutputsWithMtp:
    """What `WithMtpHead` returns: the main head's logits (as the HF model's outputs name them) and the MTP head's."""

    logits: torch.Tensor  # [b, s, V]
    mtp_logits: torch.Tensor  # [b, s, V], position i predicts token i + 2


class WithMtpHead(torch.nn.Module):
    """An HF Qwen3.5 model (`main`) and its checkpoint's MTP head (`mtp`), trained as one model."""

    accepts_loss_kwargs = False  # as transformers' Qwen-VL classes: the Trainer hands the loss no item count

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, *, packed_experts: bool):
        super().__init__()
        self.main, self.mtp = model, head
        self.config = model.config
        self.packed_experts = packed_experts  # how the checkpoint stores the head's MoE experts

    def forward(self, **inputs) -> OutputsWithMtp:
        logits, mtp_logits = logits_with_mtp(self.main, self.mtp, inputs)
        return OutputsWithMtp(logits=logits, mtp_logits=mtp_logits)


def with_mtp_head(model: torch.nn.Module, hf_path: Path) -> WithMtpHead:
    """`model` with the MTP head whose weights are `hf_path`'s `mtp.*` tensors."""
    head = load_mtp_head(model, Path(hf_path)).to(next(model.parameters()).dtype)
    return WithMtpHead(model, head, packed_experts=packed_experts(Path(hf_path)))


def mtp_token_loss_sum(
    mtp_logits: torch.Tensor, labels: torch.Tensor, learned: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(sum of the MTP token losses, how many there are) of one conversation: position i's target is token i + 2,
    learned where `learned` (from its HF labels) says so."""
    targets, learned = labels[:, 2:], learned[:, 2:]
    losses = torch.nn.functional.cross_entropy(
        mtp_logits[:, :-2].float().flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none"
    )
    return (losses * learned.flatten()).sum(), int(learned.sum())


def named_as_checkpoint(model: WithMtpHead, tensors: dict[str, torch.Tensor], main_names) -> dict[str, torch.Tensor]:
    """`tensors` named as `model`'s parameters, under checkpoint names: the HF model's through `main_names` (its
    save_pretrained names), the head's as the checkpoint's `mtp.*` tensors (experts per expert where its are)."""
    head, main = {}, {}
    for name, tensor in tensors.items():
        if name.startswith(MTP_PREFIX):
            head[name[len(MTP_PREFIX) :]] = tensor
        else:
            main[name.removeprefix("main.")] = tensor
    return {**main_names(model.main, main), **to_disk_layout(head, packed=model.packed_experts)}


def packed_experts(hf_path: Path) -> bool:
    """Whether a checkpoint's MTP experts are packed per layer (Qwen3.6) rather than stored per expert (Qwen3.5)."""
    return not any(_PER_EXPERT.search(name) for name in checkpoint_mtp_names(hf_path))
