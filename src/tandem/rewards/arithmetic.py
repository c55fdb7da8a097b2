"""Exact-match arithmetic: the last number in the final answer must equal the ground truth."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from tandem.rewards.registry import RewardResult, register_reward

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TOOL_CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def final_answer_text(response_text: str) -> str:
    """The text after the last tool response (the model's final turn), or the whole response."""
    marker = "</tool_response>"
    final = response_text.rsplit(marker, 1)[-1] if marker in response_text else response_text
    # a tool call's arguments are not an answer
    return _TOOL_CALL.sub("", final)


def extract_number(text: str) -> Fraction | None:
    """The last number in text, as an exact fraction; None when there is none."""
    numbers = _NUMBER.findall(text)
    return Fraction(numbers[-1]) if numbers else None


def check_ground_truth(ground_truth: Any) -> str | None:
    """The ground truth must be a number (an int, a decimal or a fraction's text)."""
    if ground_truth is None:
        return ("no ground_truth (give a ground_truth column or reward_model.ground_truth); "
                "the arithmetic reward compares the answer with it")
    try:
        Fraction(str(ground_truth))
    except (ValueError, ZeroDivisionError):
        return f"ground_truth {ground_truth!r} is not a number"
    return None


@register_reward("arithmetic", check_ground_truth)
def arithmetic_reward(response_text: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """1.0 when the final answer's last number equals ground_truth exactly, else 0.0."""
    answer = extract_number(final_answer_text(response_text))
    expected = Fraction(str(ground_truth))
    correct = answer is not None and answer == expected
    return RewardResult(float(correct), {"acc": float(correct),
                                         "answer": None if answer is None else str(answer)})
