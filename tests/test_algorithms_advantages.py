"""GRPO and GAE advantages: hand-computed cases and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms import gae_advantage, group_normalize, grpo_outcome_advantage, masked_mean, masked_var

PROPERTY = settings(max_examples=60, deadline=None)


def test_grpo_hand_computed_with_std():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    advantages = grpo_outcome_advantage(scores, mask, ["a", "a", "a", "a", "b"])
    # group a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group b has one member -> 0
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    per_row = torch.tensor([expected, -expected, expected, -expected, 0.0])
    torch.testing.assert_close(advantages, per_row[:, None] * mask, rtol=1e-6, atol=1e-7)
    assert advantages.shape == (5, 3)


def test_grpo_without_std_is_mean_centred_only():
    scores = torch.tensor([3.0, 1.0, 2.0, 10.0])
    mask = torch.ones(4, 2)
    advantages = grpo_outcome_advantage(scores, mask, [7, 7, 7, 8], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_grpo_group_ids_as_tensor_match_list():
    scores = torch.tensor([0.3, 0.9, -1.0, 2.0, 0.0, 0.5])
    mask = torch.ones(6, 4)
    from_list = grpo_outcome_advantage(scores, mask, ["x", "y", "x", "y", "z", "z"])
    from_tensor = grpo_outcome_advantage(scores, mask, torch.tensor([10, 4, 10, 4, -3, -3]))
    torch.testing.assert_close(from_list, from_tensor)


def test_grpo_padding_sample_is_left_out_of_its_group():
    mask = torch.ones(3, 2)
    base = grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.5]), mask, ["a", "a", "a"])
    padded_mask = torch.cat([mask, torch.zeros(1, 2)])
    padded = grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.5, 100.0]), padded_mask,
                                    ["a", "a", "a", "a"])
    torch.testing.assert_close(padded[:3], base)
    assert torch.equal(padded[3], torch.zeros(2))


def test_grpo_token_level_scores_are_summed_over_the_mask():
    token_scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 9.0, 0.0]])  # 9.0 sits on a masked token
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    advantages = grpo_outcome_advantage(token_scores, mask, ["a", "a"], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, -0.5]]))


def test_grpo_errors_name_the_argument():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        grpo_outcome_advantage(torch.zeros(2), mask, ["a", "b", "c"])
    with pytest.raises(ValueError, match="integer"):
        grpo_outcome_advantage(torch.zeros(2), mask, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="scores"):
        grpo_outcome_advantage(torch.zeros(3), mask, ["a", "b"])


groups_and_scores = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 3), min_size=n, max_size=n),
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=n, max_size=n),
))


@PROPERTY
@given(groups_and_scores, st.booleans())
def test_grpo_advantages_sum_to_zero_within_each_group(data, norm_by_std):
    groups, scores = data
    advantages = group_normalize(torch.tensor(scores, dtype=torch.float64), groups, norm_by_std)
    for group in set(groups):
        members = torch.tensor([g == group for g in groups])
        assert abs(float(advantages[members].sum())) < 1e-6
        if members.sum() == 1:
            assert float(advantages[members]) == 0.0  # a group of one has no baseline but itself


@PROPERTY
@given(st.integers(1, 8), st.floats(-100, 100, allow_nan=False), st.booleans())
def test_grpo_identical_scores_give_exactly_zero(n, score, norm_by_std):
    mask = torch.ones(n, 3)
    advantages = grpo_outcome_advantage(torch.full((n,), score), mask, [0] * n, norm_by_std)
    assert torch.equal(advantages, torch.zeros(n, 3))


@PROPERTY
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=10))
def test_grpo_normalised_group_has_unit_std(scores):
    scores = torch.tensor(scores, dtype=torch.float64)
    if float(scores.std()) < 1e-3:
        return
    advantages = group_normalize(scores, [0] * len(scores), epsilon=0.0)
    assert abs(float(advantages.std()) - 1.0) < 1e-9


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    advantages, returns = gae_advantage(rewards, values, mask, gamma=0.9, lam=0.8,
                                        whiten_advantages=False)
    # t=2: 1 - 0.7; t=1: 0.9*0.7 - 0.6 + 0.72*0.3; t=0: 0.9*0.6 - 0.5 + 0.72*0.246
    expected = torch.tensor([[0.21712, 0.246, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def test_gae_skips_a_tool_token_inside_the_trajectory():
    # The tool token (mask 0) carries garbage reward and value; it must not change anything.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.6, 0.7, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    advantages, returns = gae_advantage(rewards, values, mask, gamma=0.9, lam=0.8,
                                        whiten_advantages=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.0, 0.246, 0.3, 0.0]],
                                                        dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.0, 0.846, 1.0, 0.0]],
                                                     dtype=torch.float64))


masks_2d = st.integers(1, 4).flatmap(lambda b: st.integers(1, 7).flatmap(lambda t: st.lists(
    st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)))


@PROPERTY
@given(masks_2d, st.integers(0, 2**31 - 1))
def test_gae_with_unit_gamma_lambda_is_terminal_reward_minus_value(mask, seed):
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    final_reward = torch.randn(mask.shape[0], generator=generator, dtype=torch.float64)
    rewards = torch.zeros_like(values)
    for row in range(mask.shape[0]):
        valid = mask[row].nonzero()
        if len(valid):
            rewards[row, valid[-1]] = final_reward[row]
    advantages, returns = gae_advantage(rewards, values, mask, whiten_advantages=False)
    expected = torch.where(mask, final_reward[:, None] - values, 0.0)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.where(mask, final_reward[:, None], 0.0).expand_as(values))


@PROPERTY
@given(masks_2d, st.integers(0, 2**31 - 1), st.floats(0, 1), st.floats(0, 1))
def test_gae_ignores_everything_at_masked_positions(mask, seed, gamma, lam):
    mask = torch.tensor(mask)
    generator = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(2, *mask.shape, generator=generator, dtype=torch.float64)
    noisy_rewards = torch.where(mask, rewards, 1e6)
    noisy_values = torch.where(mask, values, -1e6)
    clean = gae_advantage(rewards, values, mask, gamma, lam)
    noisy = gae_advantage(noisy_rewards, noisy_values, mask, gamma, lam)
    torch.testing.assert_close(clean, noisy)
    assert torch.all(clean[0][~mask] == 0) and torch.all(clean[1][~mask] == 0)
    if mask.sum() >= 2 and float(masked_var(clean[0], mask)) > 0:
        assert abs(float(masked_mean(clean[0], mask))) < 1e-9
