"""PPO policy loss, value loss, loss aggregation and entropy: hand-computed cases and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms import (aggregate_loss, clipped_value_loss, entropy_bonus, entropy_from_logits,
                               loss_normalizers, ppo_clip_loss)

PROPERTY = settings(max_examples=50, deadline=None)
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _ppo_case():
    # ratio and advantage per token; the last token is masked and carries garbage.
    ratios = torch.tensor([[1.5, 0.5, 0.5, 4.0, 2.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0, 0.0]], dtype=torch.float64)
    log_probs = (old + ratios.log()).clone()
    log_probs[0, 5] = float("nan")  # garbage at the masked position must not leak anywhere
    return log_probs.requires_grad_(), old, advantages, mask


def test_ppo_loss_hand_computed_with_asymmetric_and_dual_clip():
    log_probs, old, advantages, mask = _ppo_case()
    out = ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.3,
                        clip_ratio_c=3.0)
    # 1: A>0, r=1.5 -> clipped at 1.3; 2: A>0, r=0.5 -> unclipped; 3: A<0, r=0.5 -> clipped at 0.8;
    # 4: A<0, r=4 -> dual clip caps at 3; 5: A=-2, r=2 < c -> 4; 6: masked -> 0
    torch.testing.assert_close(out.loss, torch.tensor([[-1.3, -0.5, 0.8, 3.0, 4.0, 0.0]],
                                                      dtype=torch.float64))
    assert float(out.clip_fraction_upper) == pytest.approx(1 / 5)
    assert float(out.clip_fraction_lower) == pytest.approx(1 / 5)
    assert float(out.clip_fraction_dual) == pytest.approx(1 / 5)
    out.loss.sum().backward()
    # d(-A r)/d log_probs = -A r where unclipped; 0 where a clip is active; exactly 0 when masked
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0, 4.0, 0.0]],
                                                            dtype=torch.float64))
    assert log_probs.grad[0, 5].item() == 0.0


def test_ppo_loss_importance_weights_scale_tokens():
    log_probs, old, advantages, mask = _ppo_case()
    weights = torch.tensor([[2.0, 0.5, 1.0, 1.0, 0.0, 9.0]], dtype=torch.float64)
    out = ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.3, 3.0, importance_weights=weights)
    torch.testing.assert_close(out.loss, torch.tensor([[-2.6, -0.25, 0.8, 3.0, 0.0, 0.0]],
                                                      dtype=torch.float64))


def test_ppo_loss_rejects_bad_clip_constants():
    log_probs, old, advantages, mask = _ppo_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="shape mismatch: log_probs"):
        ppo_clip_loss(log_probs, old[:, :3], advantages, mask)


token_grids = st.integers(1, 4).flatmap(lambda b: st.integers(1, 6).flatmap(lambda t: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b),
    st.integers(0, 2**31 - 1))))


@PROPERTY
@given(token_grids)
def test_ppo_loss_at_ratio_one_is_minus_advantage_and_nothing_clips(grid):
    mask, seed = grid
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=generator, dtype=torch.float64) * 5
    advantages = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    out = ppo_clip_loss(old.clone(), old, advantages, mask)
    torch.testing.assert_close(out.loss, torch.where(mask, -advantages, 0.0))
    assert float(out.clip_fraction_upper) == float(out.clip_fraction_lower) == 0.0


@PROPERTY
@given(token_grids, st.sampled_from(MODES))
def test_masked_tokens_get_exactly_zero_policy_gradient(grid, mode):
    mask, seed = grid
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=generator) * 5
    log_probs = old + torch.randn(mask.shape, generator=generator)
    log_probs = torch.where(mask, log_probs, torch.full_like(log_probs, -math.inf)).requires_grad_()
    advantages = torch.where(mask, torch.randn(mask.shape, generator=generator), math.nan)
    out = ppo_clip_loss(log_probs, old, advantages, mask)
    aggregate_loss(out.loss, mask, mode, horizon=8).backward()
    assert torch.all(log_probs.grad[~mask] == 0)
    assert torch.isfinite(log_probs.grad).all()


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 1.6, 1.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[1.5, 1.5, 1.5, 1.5, 0.0]])
    returns = torch.tensor([[0.0, 3.0, 2.0, 2.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, clip_fraction = clipped_value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # 1: clip(1.0)=1.3 -> max(1, 1.69); 2: clip(2.0)=1.7 -> max(1, 1.69); 3: inside -> 0.16;
    # 4: clip(1.0)=1.3 -> max(1, 0.49) unclipped; 5: masked
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.845, 0.08, 0.5, 0.0]]))
    assert float(clip_fraction) == pytest.approx(0.5)
    loss.sum().backward()
    # Clipped terms have no gradient; unclipped: d 0.5 (V - R)^2 = V - R
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, -0.4, -1.0, 0.0]]))


@PROPERTY
@given(token_grids, st.sampled_from(MODES))
def test_masked_tokens_get_exactly_zero_value_gradient(grid, mode):
    mask, seed = grid
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    values = torch.where(mask, torch.randn(mask.shape, generator=generator), math.nan).requires_grad_()
    old_values = torch.where(mask, torch.randn(mask.shape, generator=generator), math.inf)
    returns = torch.where(mask, torch.randn(mask.shape, generator=generator), -math.inf)
    loss, _ = clipped_value_loss(values, old_values, returns, mask, cliprange_value=0.3)
    aggregate_loss(loss, mask, mode, horizon=8).backward()
    assert torch.all(loss[~mask] == 0)
    assert torch.all(values.grad[~mask] == 0) and torch.isfinite(values.grad).all()


def test_aggregation_hand_computed_and_padding_rows_change_nothing():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # seq-mean-token-sum-norm as current verl: (1 + 2 + 4) / horizon / the 2 non-empty rows
    expected = {"token-mean": 7 / 3, "token-sum": 7.0, "seq-mean-token-sum": 3.5,
                "seq-mean-token-mean": 2.75, "seq-mean-token-sum-norm": 7 / 4 / 2}
    padded_loss = torch.cat([loss, torch.tensor([[7.0, 8.0, 9.0]])])
    padded_mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    for mode, value in expected.items():
        assert float(aggregate_loss(loss, mask, mode, horizon=4)) == pytest.approx(value)
        assert float(aggregate_loss(padded_loss, padded_mask, mode, horizon=4)) == pytest.approx(value)
    assert loss_normalizers(padded_mask) == (3, 2)


def test_aggregation_gradients_hand_computed_with_garbage_at_masked_tokens():
    # rows of 2, 1 and 0 (a padding sample) masked-in tokens; masked entries hold NaN
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    loss = torch.where(mask.bool(), torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [0.0] * 3]),
                       math.nan).requires_grad_()
    on = mask.float()
    expected = {  # mode: (value, d value / d loss)
        "token-mean": (7 / 3, on / 3),
        "token-sum": (7.0, on),
        "seq-mean-token-sum": (3.5, on / 2),
        "seq-mean-token-mean": ((1.5 + 4) / 2, torch.tensor([[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]])),
        "seq-mean-token-sum-norm": (7 / 5 / 2, on / 10),
    }
    for mode, (value, gradient) in expected.items():
        result = aggregate_loss(loss, mask, mode, horizon=5)
        (grad,) = torch.autograd.grad(result, loss)
        assert float(result.detach()) == pytest.approx(value)
        # each gradient entry is one float32 division of values <= 1: within one ulp (1.2e-7)
        torch.testing.assert_close(grad, gradient, rtol=0, atol=1.2e-7)
        assert torch.all(grad[~mask.bool()] == 0)


def test_aggregation_errors_and_empty_mask():
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="valid modes are token-mean, token-sum, seq-mean-token-sum, "
                                         "seq-mean-token-mean, seq-mean-token-sum-norm"):
        aggregate_loss(loss, mask, "mean")
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    empty = torch.zeros(2, 3)
    nan_loss = torch.full((2, 3), math.nan, requires_grad=True)
    for mode in MODES:
        value = aggregate_loss(nan_loss, empty, mode, horizon=3)
        assert float(value.detach()) == 0.0
        (grad,) = torch.autograd.grad(value, nan_loss)
        assert torch.equal(grad, torch.zeros(2, 3))


@PROPERTY
@given(st.integers(2, 6), st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from(MODES))
def test_micro_batches_with_global_counts_equal_the_full_batch(batch, length, seed, mode):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=generator) < 0.6
    mask[0, 0] = True
    per_token = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    weights = torch.randn(batch, length, dtype=torch.float64, generator=generator).requires_grad_()

    (full_grad,) = torch.autograd.grad(aggregate_loss(per_token * weights, mask, mode, horizon=5), weights)
    tokens, sequences = loss_normalizers(mask)
    accumulated = torch.zeros((), dtype=torch.float64)
    for rows in torch.arange(batch).split(2):
        accumulated = accumulated + aggregate_loss(per_token[rows] * weights[rows], mask[rows], mode,
                                                   global_token_count=tokens,
                                                   global_seq_count=sequences, horizon=5)
    (micro_grad,) = torch.autograd.grad(accumulated, weights)
    torch.testing.assert_close(micro_grad, full_grad)
    torch.testing.assert_close(accumulated, aggregate_loss(per_token * weights, mask, mode, horizon=5))


def test_entropy_from_logits_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -1e9, -1e9]]])
    entropy = entropy_from_logits(logits)
    # uniform over 4 -> log 4; probabilities (3/4, 1/4) -> -(3/4 log 3/4 + 1/4 log 1/4)
    expected = torch.tensor([[math.log(4), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]])
    torch.testing.assert_close(entropy, expected)


def test_entropy_bonus_is_negative_coefficient_times_masked_mean():
    entropy = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bonus = entropy_bonus(entropy, mask, entropy_coeff=0.01)
    assert float(bonus.detach()) == pytest.approx(-0.01 * 2.0)
    bonus.backward()
    torch.testing.assert_close(entropy.grad, -0.01 / 3 * mask.float())


def test_entropy_gradient_at_masked_positions_is_zero():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    entropy_bonus(entropy_from_logits(logits), mask, 0.1, "seq-mean-token-mean").backward()
    assert torch.all(logits.grad[~mask.bool()] == 0)
    assert torch.any(logits.grad[mask.bool()] != 0)
