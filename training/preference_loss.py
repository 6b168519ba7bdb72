"""The preference losses of qvl's `dpo` stages, per pair, from each side's log-prob under the policy and the reference.

Written from the papers and checked against TRL 1.16 (`qvl verify-training --recipe <dpo recipe>`): with
delta = (chosen - ref_chosen) - (rejected - ref_rejected), the summed log-probs of each side's learned tokens,
- sigmoid (DPO, Rafailov et al. 2023): -(1 - s) log sigmoid(beta delta) - s log sigmoid(-beta delta), the conservative
  form with label smoothing s (s = 0: TRL's "sigmoid"; with dpo_logp=mean each side's log-prob is its tokens' mean:
  TRL's "sigmoid_norm");
- robust (rDPO, Chowdhury et al. 2024): (-(1 - s) log sigmoid(beta delta) + s log sigmoid(-beta delta)) / (1 - 2 s);
- hinge (SLiC): relu(1 - beta delta);
- ipo (Azar et al. 2023): (delta_mean - 1 / (2 beta))^2 on length-normalised log-ratios, as TRL computes it;
- simpo (Meng et al. 2024, reference-free): the sigmoid loss of beta (chosen_mean - rejected_mean) - gamma;
- the NLL term of RPO (Pang et al. 2024): + weight x the chosen side's mean token NLL.
Rewards are beta x the summed log-ratios (SimPO: beta x the mean log-prob), as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qvl.recipes.preference import PreferenceConfig

# Reporting keys, each reduced as (sum over pairs, pairs) like "lm loss": logged per step and in losses.jsonl.
METRICS = (
    "reward chosen",
    "reward rejected",
    "reward accuracy",
    "reward margin",
    "logp chosen",
    "logp rejected",
    "ref logp chosen",
    "ref logp rejected",
    "nll chosen",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class PairLogps:
    """Per pair: each side's summed log-prob of its learned tokens and their count, under the policy and (where the
    loss has one) the reference; float tensors [pairs]."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


def pair_losses(logps: PairLogps, config: PreferenceConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of each pair [pairs] and the per-pair values of METRICS (detached)."""
    chosen_n, rejected_n = logps.chosen_tokens.clamp(min=1), logps.rejected_tokens.clamp(min=1)
    beta, s = config.beta, config.label_smoothing
    if config.needs_reference:
        if logps.ref_chosen is None or logps.ref_rejected is None:
            raise ValueError(f"dpo_loss={config.loss} needs the reference's log-probs; the batch carries none")
        chosen_ratio, rejected_ratio = logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected
        if config.loss == "ipo" or config.logp == "mean":
            delta = chosen_ratio / chosen_n - rejected_ratio / rejected_n
        else:
            delta = chosen_ratio - rejected_ratio
        rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    else:  # SimPO: length-normalised log-probs, no reference
        chosen_mean, rejected_mean = logps.chosen / chosen_n, logps.rejected / rejected_n
        delta = chosen_mean - rejected_mean
        rewards = beta * chosen_mean.detach(), beta * rejected_mean.detach()
    if config.loss == "sigmoid":
        loss = -(1 - s) * F.logsigmoid(beta * delta) - s * F.logsigmoid(-beta * delta)
    elif config.loss == "robust":
        loss = (-(1 - s) * F.logsigmoid(beta * delta) + s * F.logsigmoid(-beta * delta)) / (1 - 2 * s)
    elif config.loss == "hinge":
        loss = torch.relu(1 - beta * delta)
    elif config.loss == "ipo":
        loss = (delta - 1 / (2 * beta)) ** 2
    else:  # simpo
        margin = beta * delta - config.simpo_gamma
        loss = -(1 - s) * F.logsigmoid(margin) - s * F.logsigmoid(-margin)
    nll = -logps.chosen / chosen_n
    if config.nll_weight:
        loss = loss + config.nll_weight * nll
    reference = (logps.ref_chosen, logps.ref_rejected) if config.needs_reference else (None, None)
    zeros = torch.zeros_like(logps.chosen)
    metrics = {
        "reward chosen": rewards[0],
        "reward rejected": rewards[1],
        "reward accuracy": (rewards[0] > rewards[1]).to(logps.chosen.dtype),
        "reward margin": rewards[0] - rewards[1],
        "logp chosen": logps.chosen.detach(),
        "logp rejected": logps.rejected.detach(),
        "ref logp chosen": zeros if reference[0] is None else reference[0].detach(),
        "ref logp rejected": zeros if reference[1] is None else reference[1].detach(),
        "nll chosen": nll.detach(),
    }
    return loss, metrics
