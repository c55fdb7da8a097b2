"""The sampling dict of seed §6.3: training, per-row greedy, validation, budgets."""

import pytest

from tandem.agent.sampling import check_prompt_length, remaining_budget, sampling_params
from tandem.config.schema import RolloutConfig, ValKwargs
from tandem.types import SamplingParams


def config(**fields):
    return RolloutConfig(temperature=0.7, top_p=0.9, top_k=50, prompt_length=10,
                         response_length=20, **fields)


def test_training_uses_rollout_sampling_and_fixed_repetition_penalty():
    params = sampling_params(config(), validate=False, do_sample=None, max_tokens=20)
    assert params == {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0,
                      "logprobs": True, "max_tokens": 20}
    SamplingParams.from_dict(params)  # every key is one the backends understand


def test_row_greedy_flag_in_training():
    params = sampling_params(config(), validate=False, do_sample=False, max_tokens=5)
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.0, 1.0, -1)
    assert sampling_params(config(), False, True, 5)["temperature"] == 0.7


def test_validation_uses_val_kwargs_and_ignores_the_row_flag():
    greedy_val = config(val_kwargs=ValKwargs(n=2, temperature=0.5, top_p=0.8, top_k=3,
                                             do_sample=False))
    assert sampling_params(greedy_val, True, True, 5)["temperature"] == 0.0
    sampled_val = config(val_kwargs=ValKwargs(temperature=0.5, top_p=0.8, top_k=3, do_sample=True))
    params = sampling_params(sampled_val, validate=True, do_sample=False, max_tokens=5)
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.5, 0.8, 3)


def test_logprobs_follow_calculate_log_probs():
    assert sampling_params(config(calculate_log_probs=False), False, None, 1)["logprobs"] is False


def test_remaining_budget_respects_response_and_context_limits():
    assert remaining_budget(config(), prompt_tokens=10, response_tokens=0) == 20
    assert remaining_budget(config(), prompt_tokens=4, response_tokens=15) == 5
    assert remaining_budget(config(), prompt_tokens=12, response_tokens=15) == 3  # context cap


def test_prompt_length_check_names_the_field():
    check_prompt_length(10, config(), "u")
    with pytest.raises(ValueError, match=r"prompt u renders to 11 tokens.*rollout.prompt_length=10"):
        check_prompt_length(11, config(), "u")
