"""Rollout correction: truncated importance weights, rejection masks, bypass mode, metrics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms import (bypass_old_log_probs, rejection_mask, rollout_correction,
                               truncated_importance_weights)
from tandem.config.schema import RolloutCorrectionConfig

PROPERTY = settings(max_examples=50, deadline=None)


def _case():
    # old - rollout per token: log 3, log 0.6, log 1.5, (masked garbage); second row: log 1, log 1
    rollout = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    ratios = torch.tensor([[3.0, 0.6, 1.5, 1e30], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    old = rollout + ratios.log()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return old, rollout, mask


def test_token_and_sequence_truncated_weights_hand_computed():
    old, rollout, mask = _case()
    token = truncated_importance_weights(old, rollout, mask, "token", threshold=2.0)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.6, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]],
                                                   dtype=torch.float64))
    # sequence ratio of row 0: 3 * 0.6 * 1.5 = 2.7 -> truncated to 2.5
    sequence = truncated_importance_weights(old, rollout, mask, "sequence", threshold=2.5)
    torch.testing.assert_close(sequence, torch.tensor([[2.5, 2.5, 2.5, 0.0], [1.0, 1.0, 0.0, 0.0]],
                                                      dtype=torch.float64))


def test_rejection_masks_hand_computed():
    old, rollout, mask = _case()
    token = rejection_mask(old, rollout, mask, "token", low=0.5, high=2.0)
    assert token.tolist() == [[False, True, True, False], [True, True, False, False]]
    sequence = rejection_mask(old, rollout, mask, "sequence", low=0.5, high=2.0)
    assert sequence.tolist() == [[False, False, False, False], [True, True, False, False]]


def test_rollout_correction_combines_weights_mask_and_metrics():
    old, rollout, mask = _case()
    config = RolloutCorrectionConfig(importance_sampling="token", importance_sampling_threshold=2.0,
                                     rejection="token", rejection_low=0.5, rejection_high=2.0)
    result = rollout_correction(old, rollout, mask, config)
    assert result.loss_mask.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert result.metrics["rollout_correction/rejected_token_fraction"] == pytest.approx(1 / 5)
    assert result.metrics["rollout_correction/rejected_sequence_fraction"] == 0.0
    # over kept tokens: weights 0.6, 1.5, 1, 1; none of them truncated
    assert result.metrics["rollout_correction/weight_mean"] == pytest.approx(4.1 / 4)
    assert result.metrics["rollout_correction/truncated_fraction"] == 0.0

    sequence = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rejection="sequence"))
    assert sequence.weights is None
    assert sequence.metrics["rollout_correction/rejected_sequence_fraction"] == pytest.approx(0.5)
    assert sequence.metrics["rollout_correction/rejected_token_fraction"] == pytest.approx(3 / 5)


def test_no_correction_keeps_the_mask():
    old, rollout, mask = _case()
    result = rollout_correction(old, rollout, mask, RolloutCorrectionConfig())
    assert result.weights is None and result.metrics == {}
    assert torch.equal(result.loss_mask, mask.bool())


def test_long_sequences_do_not_overflow():
    rollout = torch.zeros(1, 4000)
    old = torch.full((1, 4000), 0.5)  # product of ratios = exp(2000)
    weights = truncated_importance_weights(old, rollout, torch.ones(1, 4000), "sequence", 3.0)
    torch.testing.assert_close(weights, torch.full((1, 4000), 3.0))
    kept = rejection_mask(-old, rollout, torch.ones(1, 4000), "sequence")
    assert not kept.any()


def test_bypass_mode_copies_rollout_log_probs():
    rollout = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = bypass_old_log_probs(rollout, torch.tensor([[1, 1, 0]]))
    assert torch.equal(old, torch.tensor([[-1.0, -2.0, 0.0]]))
    assert not old.requires_grad
    weights = truncated_importance_weights(old, rollout, torch.tensor([[1, 1, 0]]))
    assert torch.equal(weights, torch.tensor([[1.0, 1.0, 0.0]]))


def test_bad_arguments_are_named():
    old, rollout, mask = _case()
    with pytest.raises(ValueError, match="token or sequence"):
        truncated_importance_weights(old, rollout, mask, "geometric")
    with pytest.raises(ValueError, match="rejection_low"):
        rejection_mask(old, rollout, mask, "token", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="threshold"):
        truncated_importance_weights(old, rollout, mask, "token", threshold=0.0)


grids = st.integers(1, 4).flatmap(lambda b: st.integers(1, 6).flatmap(lambda t: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b),
    st.integers(0, 2**31 - 1))))


@PROPERTY
@given(grids, st.sampled_from(["token", "sequence"]), st.floats(1.0, 5.0))
def test_weights_are_bounded_detached_and_zero_where_masked(grid, level, threshold):
    mask, seed = grid
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(mask.shape, generator=generator) * 4
    old = (rollout + torch.randn(mask.shape, generator=generator)).requires_grad_()
    weights = truncated_importance_weights(old, rollout, mask, level, threshold)
    assert not weights.requires_grad
    assert torch.all(weights[~mask] == 0)
    assert torch.all(weights <= threshold * (1 + 1e-6)) and torch.all(weights[mask] > 0)
    kept = rejection_mask(old, torch.where(mask, rollout, math.nan), mask, level)
    assert not torch.any(kept[~mask])
