"""KL penalties (values and gradients), KL-in-reward, KL loss and the KL controllers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms import (AdaptiveKLController, FixedKLController, kl_controller_from_config,
                               kl_in_reward, kl_loss, kl_penalty, resolve_kl_type)
from tandem.config.choices import KL_TYPES, LOSS_AGG_MODES
from tandem.config.schema import KLControlConfig

PROPERTY = settings(max_examples=60, deadline=None)
LOG2 = math.log(2.0)
# log_probs = log 0.5, ref = log 0.25 -> x = log_probs - ref = log 2
K1, ABS, K2, K3 = LOG2, LOG2, 0.5 * LOG2**2, 0.5 + LOG2 - 1
EXPECTED = {  # kind: (value, d value / d log_probs); "+": the estimator's value, k2's gradient x
    "k1": (K1, 1.0), "kl": (K1, 1.0), "k1+": (K1, LOG2), "kl+": (K1, LOG2),
    "abs": (ABS, 1.0), "abs+": (ABS, LOG2),
    "k2": (K2, LOG2), "mse": (K2, LOG2), "k2+": (K2, LOG2), "mse+": (K2, LOG2),
    "k3": (K3, 1 - 0.5), "low_var_kl": (K3, 1 - 0.5), "k3+": (K3, LOG2), "low_var_kl+": (K3, LOG2),
}
# x = -log 2: the "+" gradient is x itself, where abs' is sign(x) and k1's is 1
EXPECTED_NEGATIVE = {"k1+": (-LOG2, -LOG2), "abs": (LOG2, -1.0), "abs+": (LOG2, -LOG2),
                     "k3+": (2.0 - LOG2 - 1, -LOG2), "k3": (2.0 - LOG2 - 1, 1 - 2.0)}


def test_every_verl_kl_name_is_accepted():
    assert set(EXPECTED) == set(KL_TYPES)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_kl_value_and_gradient_hand_computed(kind):
    log_probs = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    value = kl_penalty(log_probs, ref, kind)
    value.sum().backward()
    expected_value, expected_grad = EXPECTED[kind]
    assert float(value.detach()) == pytest.approx(expected_value, abs=1e-12)
    assert float(log_probs.grad) == pytest.approx(expected_grad, abs=1e-12)


@pytest.mark.parametrize("kind", sorted(EXPECTED_NEGATIVE))
def test_kl_value_and_gradient_below_the_reference(kind):
    log_probs = torch.tensor([[math.log(0.25)]], dtype=torch.float64, requires_grad=True)
    value = kl_penalty(log_probs, torch.tensor([[math.log(0.5)]], dtype=torch.float64), kind)
    value.sum().backward()
    expected_value, expected_grad = EXPECTED_NEGATIVE[kind]
    assert float(value.detach()) == pytest.approx(expected_value, abs=1e-12)
    assert float(log_probs.grad) == pytest.approx(expected_grad, abs=1e-12)


def test_aliases_resolve_to_their_estimator():
    assert resolve_kl_type("kl") == ("k1", False)
    assert resolve_kl_type("mse+") == ("k2", True)
    assert resolve_kl_type("low_var_kl") == ("k3", False)
    assert resolve_kl_type("low_var_kl+") == ("k3", True)
    assert resolve_kl_type("abs+") == ("abs", True)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_masked_tokens_get_exactly_zero_kl_and_gradient(kind):
    mask = torch.tensor([[1, 0, 1, 0]])
    log_probs = torch.tensor([[-1.0, math.nan, -0.2, -math.inf]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, 0.0, -0.1, math.nan]], dtype=torch.float64)
    value = kl_penalty(log_probs, ref, kind, mask)
    value.sum().backward()
    assert value[0, 1] == 0 and value[0, 3] == 0
    assert log_probs.grad[0, 1] == 0 and log_probs.grad[0, 3] == 0
    assert torch.isfinite(value).all() and torch.isfinite(log_probs.grad).all()


def test_abs_gradient_sign_follows_the_difference():
    log_probs = torch.tensor([[math.log(0.25)]], requires_grad=True)
    kl_penalty(log_probs, torch.tensor([[math.log(0.5)]]), "abs").sum().backward()
    assert float(log_probs.grad) == -1.0


def test_k3_is_clamped_for_stability():
    value = kl_penalty(torch.tensor([[-40.0]]), torch.tensor([[0.0]]), "k3")
    assert float(value) == 10.0


def test_unknown_kl_type_lists_the_valid_ones():
    valid = "valid types are k1, kl, abs, k2, mse, k3, low_var_kl, k1\\+, kl\\+, abs\\+, k2\\+"
    for name in ("full", "k4", "k3++"):
        with pytest.raises(ValueError, match=valid):
            kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), name)


pairs = st.lists(st.tuples(st.floats(-8, 0), st.floats(-8, 0)), min_size=1, max_size=12)


@PROPERTY
@given(pairs, st.sampled_from([kind for kind in KL_TYPES if kind.endswith("+")]))
def test_plus_types_match_their_estimator_in_value_and_k2_in_gradient(values, kind):
    log_probs = torch.tensor([[a for a, _ in values]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[b for _, b in values]], dtype=torch.float64)
    straight = kl_penalty(log_probs, ref, kind)
    torch.testing.assert_close(straight, kl_penalty(log_probs, ref, kind[:-1]))
    (grad,) = torch.autograd.grad(straight.sum(), log_probs)
    (k2_grad,) = torch.autograd.grad(kl_penalty(log_probs, ref, "k2").sum(), log_probs)
    torch.testing.assert_close(grad, k2_grad)
    # k3 = exp(d) - d - 1 >= 0; in float64 near d = 0 its three roundings of values ~1 leave
    # up to ~3 ulp(1) below zero (hypothesis found -1.1e-16 at d = 1.1e-13)
    assert torch.all(kl_penalty(log_probs, ref, "k3") >= -4 * torch.finfo(torch.float64).eps)


@PROPERTY
@given(st.lists(st.booleans(), min_size=1, max_size=10), st.sampled_from(sorted(EXPECTED)),
       st.sampled_from(LOSS_AGG_MODES))
def test_kl_loss_gives_masked_tokens_exactly_zero_gradient(mask, kind, mode):
    mask = torch.tensor([mask])
    log_probs = torch.where(mask, torch.linspace(-3, -0.1, mask.shape[1]), math.nan).requires_grad_()
    ref = torch.where(mask, torch.full(mask.shape, -1.0), math.inf)
    loss = kl_loss(log_probs, ref, mask, kind, mode, horizon=16)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(log_probs.grad[~mask] == 0)


def test_kl_in_reward_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    log_probs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.5, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # the last row is a padding sample
    rewards, current_kl = kl_in_reward(scores, log_probs, ref, mask, kl_coef=0.1, kl_type="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 1.95, 0.0],
                                                      [0.0, 0.0, 0.0]]))
    # per-sequence means: (0.5 + 0 - 0.5) / 3 = 0 and (1 + 0.5) / 2 = 0.75; padding row excluded
    assert current_kl == pytest.approx(0.375)


def test_fixed_controller_never_moves():
    controller = kl_controller_from_config(KLControlConfig(type="fixed", kl_coef=0.05))
    assert isinstance(controller, FixedKLController)
    controller.update(current_kl=10.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_controller_hand_computed():
    controller = kl_controller_from_config(KLControlConfig(type="adaptive", kl_coef=0.1,
                                                           target_kl=0.05, horizon=100))
    assert isinstance(controller, AdaptiveKLController)
    controller.update(current_kl=0.055, n_steps=10)  # error 0.1 -> x (1 + 0.1 * 10 / 100)
    assert controller.value == pytest.approx(0.101)
    controller.update(current_kl=1.0, n_steps=10)  # error 19 clipped to 0.2 -> x 1.02
    assert controller.value == pytest.approx(0.10302)
    controller.update(current_kl=0.0, n_steps=10)  # error -1 clipped to -0.2 -> x 0.98
    assert controller.value == pytest.approx(0.1009596)

    restored = AdaptiveKLController(0.5, 0.05, 100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)
