"""Per-step metrics and masked reductions: hand-computed values; padding contributes exactly 0."""

import math

import pytest
import torch

from tandem.algorithms import (logprob_gap_metrics, masked_max, masked_mean, masked_var, masked_whiten,
                               policy_metrics, ppo_clip_loss)


def test_logprob_gap_hand_computed_and_padding_changes_nothing():
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -1.0, 7.0], [-0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = logprob_gap_metrics(rollout, old, mask)
    # d = old - rollout over valid tokens: -0.5, 1.0, 0.0
    assert metrics["rollout_gap/abs_diff_mean"] == pytest.approx(0.5)
    assert metrics["rollout_gap/abs_diff_max"] == pytest.approx(1.0)
    assert metrics["rollout_gap/kl_k1"] == pytest.approx(-0.5 / 3)
    k3 = (math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)
    assert metrics["rollout_gap/kl_k3"] == pytest.approx(k3 / 3, rel=1e-6)

    padded = logprob_gap_metrics(torch.cat([rollout, torch.zeros(1, 3)]),
                                 torch.cat([old, torch.full((1, 3), -50.0)]),
                                 torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)]))
    assert padded == pytest.approx(metrics)


def test_logprob_gap_of_an_empty_batch_is_zero_not_nan():
    metrics = logprob_gap_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert all(value == 0.0 for value in metrics.values())


def test_policy_metrics_collects_clip_fractions_kl_and_entropy():
    old = torch.zeros(1, 3)
    log_probs = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    out = ppo_clip_loss(log_probs, old, torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 0]]))
    metrics = policy_metrics(out, torch.tensor([[1, 1, 0]]), kl=torch.tensor([[0.2, 0.4, 5.0]]),
                             entropy=torch.tensor([[1.0, 3.0, 9.0]]))
    assert metrics["policy/clip_fraction_upper"] == pytest.approx(0.5)
    assert metrics["policy/clip_fraction_lower"] == 0.0
    assert metrics["policy/clip_fraction_dual"] == 0.0
    assert metrics["policy/ppo_kl"] == pytest.approx(-math.log(2.0) / 2)
    assert metrics["policy/kl_mean"] == pytest.approx(0.3)
    assert metrics["policy/entropy_mean"] == pytest.approx(2.0)


def test_masked_reductions_hand_computed():
    values = torch.tensor([[1.0, 3.0, math.nan], [5.0, math.inf, -math.inf]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(masked_mean(values, mask)) == pytest.approx(3.0)
    assert masked_mean(values, mask, dim=-1).tolist() == [2.0, 5.0]
    assert float(masked_var(values, mask)) == pytest.approx(4.0)  # unbiased: (4 + 0 + 4) / 2
    assert float(masked_max(values, mask)) == 5.0
    whitened = masked_whiten(values, mask)
    torch.testing.assert_close(whitened, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert float(masked_mean(values, torch.zeros(2, 3))) == 0.0
