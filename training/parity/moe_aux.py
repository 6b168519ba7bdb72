"""The reference side of a parity run with the MoE load-balancing loss on: Megatron-Core's auxiliary loss, as its
router attaches it, computed on transformers' routers for the conversations of each pack.

Megatron-Core's router (megatron/core/transformer/moe/router.py, `_apply_aux_loss` / `_apply_global_aux_loss`)
adds, per MoE layer (the MTP layer's included) and micro-batch m of T_m tokens,

    aux(m, layer) = coeff x E / (k x T_m^2) x sum_e counts_e x sum_{t in m} softmax(router logits_t)_e

with counts_e the tokens whose top-k experts include e: the micro-batch's own ("aux_loss", Qwen3-VL-MoE) or the
mean over the step's micro-batches so far ("global_aux_loss", Qwen3.5-VL-MoE). Under `calculate_per_token_loss`
the gradient it attaches is aux x T_m, and every gradient is divided by the step's learned tokens N afterwards, so
the step minimises  (sum of the token losses + sum over m and layers of T_m x aux(m, layer)) / N.  The counts are
constants of the step (top-k is not differentiated) and the probability sum is a sum over tokens, so the term
splits over the conversations of a pack: conversation c of pack m adds

    coeff x E / (k x T_m x N) x sum_layers sum_e counts_e(m, layer) x sum_{t in c} softmax(logits_t)_e

`MoeAuxReference` reads every router's logits and top-k choices through forward hooks, counts each pack's choices
in a no-grad pass over the step's conversations before the step, and gives each conversation its term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qvl.foundation.errors import ConfigError

# Megatron-Core's load-balancing types this reference reproduces
KINDS = ("aux_loss", "global_aux_loss")
# The names its router logs them under (MoE metrics tracker)
LOAD_BALANCING_NAMES = ("load_balancing_loss", "global_load_balancing_loss")


@dataclass(kw_only=True, slots=True, frozen=True)
class PackSlot:
    """Where a conversation sat in qvl's step: its pack's index in the step and the pack's token count."""

    pack: int
    tokens: int


def is_router(module: torch.nn.Module) -> bool:
    """transformers' MoE routers (Qwen3-VL-MoE, Qwen3.5-MoE): forward returns (logits, scores, top-k indices)."""
    return type(module).__name__.endswith("TopKRouter")


@dataclass(kw_only=True, slots=True)
class MoeAuxReference:
    """Megatron-Core's load-balancing loss on the reference model's routers (module docstring)."""

    kind: str
    coeff: float
    num_experts: int
    topk: int
    routers: list[torch.nn.Module]
    logits: list[torch.Tensor | None] = field(default_factory=list)  # per router, the last forward's
    chosen: list[torch.Tensor | None] = field(default_factory=list)  # per router, the last forward's top-k indices
    counts: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # pack -> per router [E] token counts

    @classmethod
    def attach(cls, model: torch.nn.Module, *, kind: str, coeff: float) -> MoeAuxReference:
        routers = [m for m in model.modules() if is_router(m)]
        if kind not in KINDS or not routers:
            raise ConfigError(
                f"model.moe_router_load_balancing_type={kind!r}: the check reproduces {' and '.join(KINDS)} on "
                f"transformers' routers only; pass model.moe_aux_loss_coeff=0 to compare without it"
            )
        ref = cls(
            kind=kind,
            coeff=coeff,
            num_experts=routers[0].num_experts,
            topk=routers[0].top_k,
            routers=routers,
            logits=[None] * len(routers),
            chosen=[None] * len(routers),
        )
        for index, router in enumerate(routers):
            router.register_forward_hook(ref._hook(index))
        return ref

    def _hook(self, index: int):
        def keep(module, args, output):
            self.logits[index], self.chosen[index] = output[0], output[2]

        return keep

    def count_step(self, model: torch.nn.Module, conversations: list[dict], slots: list[PackSlot]) -> None:
        """Each pack's top-k counts per router at the step's starting weights (a no-grad pass)."""
        self.counts = {}
        with torch.no_grad():
            for inputs, slot in zip(conversations, slots, strict=True):
                model(**{k: v for k, v in inputs.items() if k != "labels"})
                per_router = [self._counts(chosen) for chosen in self.chosen]
                held = self.counts.setdefault(slot.pack, [torch.zeros(self.num_experts) for _ in self.routers])
                for total, part in zip(held, per_router, strict=True):
                    total += part

    def _counts(self, chosen: torch.Tensor) -> torch.Tensor:
        return torch.bincount(chosen.flatten().cpu(), minlength=self.num_experts).float()

    def tokens_per_expert(self, pack: int) -> list[torch.Tensor]:
        """The counts the router used for `pack`: its own, or the mean over packs 0..pack (global_aux_loss)."""
        if self.kind == "aux_loss":
            return self.counts[pack]
        seen = [self.counts[p] for p in range(pack + 1)]
        return [sum(parts) / len(seen) for parts in zip(*seen, strict=True)]

    def term(self, slot: PackSlot, learned_tokens: torch.Tensor) -> torch.Tensor:
        """The conversation's share of the step's load-balancing loss, from its forward just run."""
        scale = self.coeff * self.num_experts / (self.topk * slot.tokens * learned_tokens)
        total = 0.0
        for logits, counts in zip(self.logits, self.tokens_per_expert(slot.pack), strict=True):
            probs = torch.softmax(logits.float().reshape(-1, self.num_experts), dim=-1)
            total = total + (probs.sum(0) * counts.to(probs.device)).sum()
        return scale * total

    def logged(self, term: torch.Tensor, slot: PackSlot, learned_tokens: torch.Tensor) -> float:
        """The conversation's share of the loss Megatron-Core's routers add for its pack, coefficient included:
        aux(m, layer) summed over layers, i.e. the term without its T_m / N weight. (Megatron-Core logs it over the
        coefficient, which would hide a wrong coefficient; qvl's side is read with it too.)"""
        return float(term.detach()) * float(learned_tokens) / slot.tokens
