"""Rule-based rewards by data source."""

import pytest

from tandem.rewards import RewardResult, compute_reward, register_reward, reward_names


@pytest.mark.parametrize("text, truth, score", [
    ("The answer is 988.", "988", 1.0),
    ("The answer is 988.", 988, 1.0),
    ("I think 12, no: 988", "988", 1.0),
    ("The answer is 989.", "988", 0.0),
    ("no number here", "988", 0.0),
    ("The answer is -12.", "-12", 1.0),
    ("The answer is 2.50", "2.5", 1.0),
    # the tool call's arguments are not an answer, only the text after the last tool response
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "900 + 88"}}</tool_call>', "88", 0.0),
    ("<tool_response>988</tool_response>The answer is 98.", "988", 0.0),
    ("<tool_response>988</tool_response>The answer is 988.", "988", 1.0),
])
def test_arithmetic_exact_match(text, truth, score):
    result = compute_reward("arithmetic", text, truth)
    assert result.score == score and result.extra["acc"] == score


def test_unknown_data_source_names_the_registered_ones():
    with pytest.raises(KeyError, match="arithmetic") as error:
        compute_reward("gsm9k", "1", "1")
    assert "register_reward" in str(error.value)


def test_register_a_reward():
    @register_reward("test_always_half")
    def half(text, truth, extra):
        return RewardResult(0.5, {"seen": extra["k"]})

    assert "test_always_half" in reward_names()
    result = compute_reward("test_always_half", "x", None, {"k": 3})
    assert result.score == 0.5 and result.extra == {"seen": 3}
