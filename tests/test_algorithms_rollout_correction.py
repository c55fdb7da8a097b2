"""Rollout correction: truncated and IcePop importance weights, batch normalisation, rejection
criteria (tandem's and verl's), bypass mode, metrics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms import (batch_normalize_weights, bypass_old_log_probs, icepop_importance_weights,
                               parse_rejection, ppo_clip_loss, rejection_mask, rollout_correction,
                               truncated_importance_weights)
from tandem.algorithms.rejection import REJECTION_CRITERIA, criterion_statistic
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


# ---- verl's rejection criteria, IcePop weights, batch normalisation ----------------------------

# Per-token statistics of _case() row 0 (ratios r = 3, 0.6, 1.5), by their formulas:
# k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. Row 1 has r = 1: every statistic is 0.
ROW0 = [3.0, 0.6, 1.5]
K1 = [-math.log(r) for r in ROW0]
K2 = [0.5 * math.log(r) ** 2 for r in ROW0]
K3 = [r - 1 - math.log(r) for r in ROW0]


def _keep(rejection, threshold=None, low=0.5, high=2.0):
    old, rollout, mask = _case()
    return rejection_mask(old, rollout, mask, rejection, low, high, threshold).tolist()


def _rows(row0_kept):
    # row 0 keeps tokens by row0_kept (3 in, 1 masked); row 1 (ratio 1) always passes.
    return [list(row0_kept) + [False], [True, True, False, False]]


def test_token_criteria_hand_computed():
    # token_k1 "0.25_1.5" bounds pi_rollout / pi_old = 1 / r (verl's -log r), not r:
    # 1/3, 1/0.6 = 1.67, 1/1.5 = 0.67 -> only 1.67 is above 1.5
    assert [math.log(0.25) <= k <= math.log(1.5) for k in K1] == [True, False, True]
    assert _keep("token_k1", "0.25_1.5") == _rows([True, False, True])
    # tandem's "token" with the same numbers bounds r itself: 3 is above 1.5
    assert _keep("token", low=0.25, high=1.5) == _rows([False, True, True])
    # one number u for k1 means [1/u, u]
    assert _keep("token_k1", 2.0) == _keep("token_k1", "0.5_2.0") == _rows([False, True, True])
    assert [k <= 0.5 for k in K2] == [False, True, True]
    assert _keep("token_k2", 0.5) == _rows([False, True, True])
    assert [k <= 0.1 for k in K3] == [False, False, True]
    assert _keep("token_k3", "0.1") == _rows([False, False, True])


@pytest.mark.parametrize("rejection, threshold, row0_statistic, row0_kept", [
    ("seq_sum_k1", "0.5_2.0", sum(K1), False),  # -log 2.7 < log 0.5
    ("seq_mean_k1", "0.5_2.0", sum(K1) / 3, True),  # geometric mean ratio 2.7^(1/3) = 1.39
    ("seq_sum_k2", "0.5", sum(K2), False),  # 0.82
    ("seq_mean_k2", "0.5", sum(K2) / 3, True),  # 0.27
    ("seq_mean_k2", "0.25", sum(K2) / 3, False),
    ("seq_max_k2", "0.5", max(K2), False),  # 0.60
    ("seq_max_k2", "1", max(K2), True),
    ("seq_sum_k3", "1.0", sum(K3), False),  # 1.11
    ("seq_mean_k3", "0.4", sum(K3) / 3, True),  # 0.37
    ("seq_max_k3", "0.9", max(K3), False),  # 0.90 > 0.9
    ("seq_max_k3", "0.91", max(K3), True),
])
def test_sequence_criteria_hand_computed(rejection, threshold, row0_statistic, row0_kept):
    old, rollout, mask = _case()
    criterion = parse_rejection(rejection, threshold=threshold)[0]
    statistic = criterion_statistic(old - rollout, mask, criterion)
    assert float(statistic[0, 0]) == pytest.approx(row0_statistic, abs=1e-12)
    assert torch.all(statistic[0, :3] == statistic[0, 0])
    assert float(statistic[1, 0]) == 0.0
    assert _keep(rejection, threshold) == _rows([row0_kept] * 3)


def test_criteria_combine_with_and_and_thresholds_broadcast():
    # token_k2 <= 0.5 drops the ratio-3 token; seq_mean_k1 in [0.5, 2] keeps both rows
    assert _keep("token_k2, seq_mean_k1", "0.5,0.5_2.0") == _rows([False, True, True])
    # one threshold for all: token_k3 <= 0.1 and seq_max_k2 <= 0.1 (0.60: row 0 goes)
    assert _keep("token_k3,seq_max_k2", "0.1") == _rows([False, False, False])
    # duplicates are dropped before thresholds are matched to names
    assert _keep("token_k2,token_k2,seq_sum_k2", "0.5,1.0") == _rows([False, True, True])
    # tandem's names mix with verl's; thresholds count verl's names only
    assert _keep("token,seq_max_k3", "0.95") == _rows([False, True, True])


def test_correction_metrics_per_criterion():
    old, rollout, mask = _case()
    config = RolloutCorrectionConfig(rejection="token_k2,seq_max_k3", rejection_threshold="0.5,0.91")
    result = rollout_correction(old, rollout, mask, config)
    metrics = result.metrics
    assert metrics["rollout_correction/token_k2/rejected_token_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_correction/token_k2/mean"] == pytest.approx(sum(K2) / 5)
    assert metrics["rollout_correction/seq_max_k3/rejected_token_fraction"] == 0.0
    assert metrics["rollout_correction/seq_max_k3/mean"] == pytest.approx(max(K3) / 2)
    assert metrics["rollout_correction/rejected_token_fraction"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("rejection, threshold, message", [
    ("seq_max_k1", None, "unknown rejection criterion 'seq_max_k1'; valid values are none or "
                         "comma-separated criteria from token, sequence, token_k1"),
    ("token,none", None, "is not a rejection setting"),
    ("token_k3", None, "rejection_threshold \\(verl's rollout_rs_threshold\\) must be set for token_k3"),
    ("token_k2,seq_mean_k3", "0.1,0.2,0.3", "has 3 entries for the 2 criteria"),
    ("token_k2", "0.5_2.0", "one positive upper bound"),
    ("token_k1", "2.0_0.5", "0 < lower <= upper"),
    ("token_k1", "abc", "is not a number"),
    ("sequence", None, "rejection_low <= rejection_high"),
    ("token", "0.5_2.0", "would be ignored: only verl's criteria"),
])
def test_bad_rejection_settings_are_named(rejection, threshold, message):
    with pytest.raises(ValueError, match=message):
        low, high = (2.0, 1.0) if rejection == "sequence" else (0.5, 2.0)
        parse_rejection(rejection, low, high, threshold)


def test_icepop_weights_hand_computed():
    old, rollout, mask = _case()
    token = icepop_importance_weights(old, rollout, mask, "token", low=0.5, high=2.0)
    # ratio 3 is outside [0.5, 2] -> 0 (not truncated to 2); the masked token -> 0
    torch.testing.assert_close(token, torch.tensor([[0.0, 0.6, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]],
                                                   dtype=torch.float64))
    # sequence ratio 2.7: zeroed for an upper bound 2, kept whole for 3
    sequence = icepop_importance_weights(old, rollout, mask, "sequence", low=0.5, high=2.0)
    torch.testing.assert_close(sequence, torch.tensor([[0.0] * 4, [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64))
    sequence = icepop_importance_weights(old, rollout, mask, "sequence", low=0.5, high=3.0)
    torch.testing.assert_close(sequence, torch.tensor([[2.7, 2.7, 2.7, 0.0], [1.0, 1.0, 0.0, 0.0]],
                                                      dtype=torch.float64))


def test_batch_normalised_weights_hand_computed():
    old, rollout, mask = _case()
    token = truncated_importance_weights(old, rollout, mask, "token", threshold=2.0)
    normalised, factor = batch_normalize_weights(token, mask, "token")
    assert factor == pytest.approx((2.0 + 0.6 + 1.5 + 1 + 1) / 5)  # over the 5 masked-in tokens
    torch.testing.assert_close(normalised, token / factor)
    sequence = truncated_importance_weights(old, rollout, mask, "sequence", threshold=2.5)
    normalised, factor = batch_normalize_weights(sequence, mask, "sequence")
    assert factor == pytest.approx((2.5 + 1.0) / 2)  # one weight per sequence, not per token
    torch.testing.assert_close(normalised[0, 0], torch.tensor(2.5 / 1.75, dtype=torch.float64))
    assert normalised[0, 3] == 0 and normalised[1, 2] == 0
    zeros, factor = batch_normalize_weights(torch.zeros(2, 4), mask, "token")
    assert factor == 1.0 and torch.equal(zeros, torch.zeros(2, 4))


def test_rollout_correction_icepop_and_batch_normalisation():
    old, rollout, mask = _case()
    config = RolloutCorrectionConfig(importance_sampling="token", importance_sampling_mode="icepop",
                                     importance_sampling_low=0.5, importance_sampling_threshold=2.0,
                                     importance_sampling_batch_normalize=True)
    result = rollout_correction(old, rollout, mask, config)
    factor = (0.6 + 1.5 + 1 + 1) / 5
    assert result.metrics["rollout_correction/batch_norm_factor"] == pytest.approx(factor)
    assert result.metrics["rollout_correction/zeroed_fraction"] == pytest.approx(1 / 5)
    assert result.metrics["rollout_correction/weight_mean"] == pytest.approx(1.0)
    torch.testing.assert_close(result.weights, torch.tensor(
        [[0.0, 0.6, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64) / factor)
    assert torch.equal(result.loss_mask, mask.bool())


def test_icepop_weights_scale_the_policy_gradient_and_carry_none():
    old, rollout, mask = _case()
    old = old.clone().requires_grad_()
    weights = icepop_importance_weights(old, rollout, mask, "token", 0.5, 2.0)
    assert not weights.requires_grad
    log_probs = old.detach().clone().requires_grad_()
    advantages = torch.ones_like(log_probs)
    loss = ppo_clip_loss(log_probs, old.detach(), advantages, mask, importance_weights=weights).loss
    loss.sum().backward()
    # at ratio 1, d(-A r w)/d log_probs = -A w: 0 for the zeroed and the masked tokens
    torch.testing.assert_close(log_probs.grad, -weights)


@PROPERTY
@given(grids, st.sampled_from(["token", "sequence"]), st.sampled_from(REJECTION_CRITERIA[2:]),
       st.booleans())
def test_garbage_at_masked_tokens_never_reaches_weights_or_masks(grid, level, criterion, normalise):
    mask, seed = grid
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    rollout = torch.where(mask, -torch.rand(mask.shape, generator=generator) * 4, math.nan)
    old = torch.where(mask, rollout + torch.randn(mask.shape, generator=generator) * 0.3, math.inf)
    config = RolloutCorrectionConfig(importance_sampling=level, importance_sampling_mode="icepop",
                                     importance_sampling_batch_normalize=normalise,
                                     rejection=criterion, rejection_threshold="0.5_2.0"
                                     if criterion.endswith("k1") else "0.2")
    result = rollout_correction(old, rollout, mask, config)
    assert torch.all(result.weights[~mask] == 0) and torch.isfinite(result.weights).all()
    assert not torch.any(result.loss_mask[~mask])
    # a criterion on clean inputs gives the same keep mask as on garbage-padded inputs
    clean = rollout_correction(torch.where(mask, old, 0.0), torch.where(mask, rollout, 0.0), mask, config)
    assert torch.equal(clean.loss_mask, result.loss_mask)
    torch.testing.assert_close(clean.weights, result.weights)
