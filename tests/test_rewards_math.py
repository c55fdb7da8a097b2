"""The built-in math reward: HF's math-verify compares the final answer with the ground truth
symbolically, for verl's math data sources, in any thread (no SIGALRM), and names its install."""

import threading

import pytest

from tandem.rewards.math import MATH_SOURCES, check_math_ground_truth, math_reward
from tandem.rewards.registry import compute_reward, reward_input_problem

pytest.importorskip("math_verify")


@pytest.mark.parametrize("response, truth, score", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So x = 1/2.", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{3}.", "1/2", 0.0),
    ("The answer is 71.", "She sold 48/2 = 24 clips in May.\n#### 72", 0.0),
    ("The answer is 72.", "She sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("no number at all", "72", 0.0),
    # a tool call's arguments are no answer: the final turn after the tool response counts
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 12"}}</tool_call>'
     "<tool_response>72</tool_response> It is 72.", "72", 1.0),
])
def test_final_answers_are_compared_as_math(response, truth, score):
    result = math_reward(response, truth, {})
    assert result.score == score and result.extra == {"acc": score}


def test_verls_math_data_sources_route_to_it_in_any_thread():
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        compute_reward(source, "\\boxed{72}", "72").score for source in MATH_SOURCES))
    worker.start()
    worker.join()
    assert results == [1.0] * len(MATH_SOURCES)


def test_rows_are_checked_at_load_naming_what_is_missing(monkeypatch):
    assert reward_input_problem("openai/gsm8k", "72") is None
    assert "no ground_truth" in reward_input_problem("openai/gsm8k", None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real(name, *a))
    assert check_math_ground_truth("72") == ("the math reward needs the math-verify package: "
                                             "pip install 'math-verify>=0.7'")
