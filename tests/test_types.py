"""TokenOutput and SamplingParams: the records every layer exchanges."""

import pytest

from tandem.types import SamplingParams, TokenOutput


def test_token_output_requires_one_logprob_per_token():
    out = TokenOutput([1, 2, 3], [-0.1, -0.2, -0.3], "completed", {"global_steps": 4})
    assert out.global_steps == 4
    with pytest.raises(ValueError, match="exactly one logprob per sampled token"):
        TokenOutput([1, 2, 3], [-0.1], "completed", {"global_steps": 0})
    with pytest.raises(ValueError, match="stop_reason"):
        TokenOutput([1], None, "finished", {"global_steps": 0})


def test_sampling_params_from_dict():
    params = SamplingParams.from_dict({"temperature": 0, "top_p": 1.0, "top_k": -1,
                                       "repetition_penalty": 1.0, "logprobs": True, "max_tokens": 5,
                                       "stop_token_ids": [7, 8]})
    assert params.greedy and params.logprobs is True and params.stop_token_ids == (7, 8)
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("bad, words", [
    ({"temperture": 1.0}, "unknown sampling keys ['temperture']"),
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": 0}, "top_k=0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ({"max_tokens": -3}, "max_tokens=-3"),
    ({"max_tokens": 0}, "max_tokens=0"),
])
def test_sampling_params_range_checks(bad, words):
    with pytest.raises(ValueError) as error:
        SamplingParams.from_dict(bad)
    assert words in str(error.value)
