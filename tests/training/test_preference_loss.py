"""The preference losses (qvl.training.preference_loss) against their closed forms, and the settings' checks."""

from __future__ import annotations

import math

import pytest
import torch

from qvl.foundation.errors import ConfigError
from qvl.recipes.preference import PreferenceConfig
from qvl.training.preference_loss import METRICS, PairLogps, pair_losses

# Two pairs: summed log-probs of each side's learned tokens, their counts and the reference's.
LOGPS = PairLogps(
    chosen=torch.tensor([-10.0, -4.0], dtype=torch.float64),
    rejected=torch.tensor([-12.0, -3.0], dtype=torch.float64),
    chosen_tokens=torch.tensor([5.0, 2.0], dtype=torch.float64),
    rejected_tokens=torch.tensor([4.0, 3.0], dtype=torch.float64),
    ref_chosen=torch.tensor([-11.0, -4.5], dtype=torch.float64),
    ref_rejected=torch.tensor([-11.5, -2.0], dtype=torch.float64),
)
DELTA = [(-10 + 11) - (-12 + 11.5), (-4 + 4.5) - (-3 + 2)]  # 1.5, 1.5 summed log-ratios
DELTA_MEAN = [1 / 5 - (-0.5) / 4, 0.5 / 2 - (-1) / 3]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def losses(**settings) -> list[float]:
    loss, _ = pair_losses(LOGPS, PreferenceConfig(**settings))
    return loss.tolist()


def test_sigmoid_is_dpo_and_label_smoothing_is_conservative_dpo():
    assert losses(beta=0.1) == pytest.approx([-log_sigmoid(0.1 * d) for d in DELTA])
    s = 0.2
    expected = [-(1 - s) * log_sigmoid(0.1 * d) - s * log_sigmoid(-0.1 * d) for d in DELTA]
    assert losses(beta=0.1, label_smoothing=s) == pytest.approx(expected)
    # dpo_logp=mean scores each side by its tokens' mean log-ratio (TRL's sigmoid_norm)
    assert losses(beta=0.5, logp="mean") == pytest.approx([-log_sigmoid(0.5 * d) for d in DELTA_MEAN])


def test_robust_hinge_and_ipo():
    s, beta = 0.1, 0.3
    robust = [(-(1 - s) * log_sigmoid(beta * d) + s * log_sigmoid(-beta * d)) / (1 - 2 * s) for d in DELTA]
    assert losses(loss="robust", beta=beta, label_smoothing=s) == pytest.approx(robust)
    assert losses(loss="hinge", beta=beta) == pytest.approx([max(0.0, 1 - beta * d) for d in DELTA])
    # IPO always length-normalises the log-ratios (TRL's choice, confirmed by the IPO authors)
    assert losses(loss="ipo", beta=beta) == pytest.approx([(d - 1 / (2 * beta)) ** 2 for d in DELTA_MEAN])


def test_simpo_needs_no_reference_and_rpo_adds_the_chosen_nll():
    no_reference = PairLogps(
        chosen=LOGPS.chosen,
        rejected=LOGPS.rejected,
        chosen_tokens=LOGPS.chosen_tokens,
        rejected_tokens=LOGPS.rejected_tokens,
    )
    beta, gamma = 2.0, 0.7
    margins = [beta * (c / nc - r / nr) - gamma for c, r, nc, nr in zip([-10, -4], [-12, -3], [5, 2], [4, 3])]
    loss, metrics = pair_losses(no_reference, PreferenceConfig(loss="simpo", beta=beta, simpo_gamma=gamma))
    assert loss.tolist() == pytest.approx([-log_sigmoid(m) for m in margins])
    assert metrics["reward chosen"].tolist() == pytest.approx([beta * -10 / 5, beta * -4 / 2])
    with pytest.raises(ValueError, match="needs the reference"):
        pair_losses(no_reference, PreferenceConfig(loss="sigmoid"))
    nll = [10 / 5, 4 / 2]  # the chosen side's mean token NLL
    rpo = [-log_sigmoid(0.1 * d) + 0.5 * n for d, n in zip(DELTA, nll)]
    assert losses(beta=0.1, nll_weight=0.5) == pytest.approx(rpo)


def test_metrics_are_the_rewards_trl_logs():
    _, metrics = pair_losses(LOGPS, PreferenceConfig(beta=0.1))
    assert set(metrics) == set(METRICS)
    assert metrics["reward chosen"].tolist() == pytest.approx([0.1 * 1.0, 0.1 * 0.5])
    assert metrics["reward rejected"].tolist() == pytest.approx([0.1 * -0.5, 0.1 * -1.0])
    assert metrics["reward accuracy"].tolist() == [1.0, 1.0]
    assert metrics["reward margin"].tolist() == pytest.approx([0.15, 0.15])


def test_swapped_sides_and_beta_change_the_loss():
    base = losses(beta=0.1)
    swapped = PairLogps(
        chosen=LOGPS.rejected,
        rejected=LOGPS.chosen,
        chosen_tokens=LOGPS.rejected_tokens,
        rejected_tokens=LOGPS.chosen_tokens,
        ref_chosen=LOGPS.ref_rejected,
        ref_rejected=LOGPS.ref_chosen,
    )
    assert pair_losses(swapped, PreferenceConfig(beta=0.1))[0].tolist() != pytest.approx(base)
    assert losses(beta=0.2) != pytest.approx(base)


def test_gradient_pushes_chosen_up_and_rejected_down():
    chosen = LOGPS.chosen.clone().requires_grad_()
    rejected = LOGPS.rejected.clone().requires_grad_()
    logps = PairLogps(**{**{k: getattr(LOGPS, k) for k in LOGPS.__slots__}, "chosen": chosen, "rejected": rejected})
    loss, _ = pair_losses(logps, PreferenceConfig(beta=0.1))
    loss.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss": "kto"}, "dpo_loss='kto' is not supported"),
        ({"beta": 0.0}, "dpo_beta=0.0 must be positive"),
        ({"loss": "robust", "label_smoothing": 0.5}, r"must be in \[0, 0.5\)"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "does not apply to dpo_loss=ipo"),
        ({"nll_weight": -1.0}, "dpo_nll_weight=-1.0"),
        ({"logp": "max"}, "dpo_logp='max'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        PreferenceConfig(**settings)
