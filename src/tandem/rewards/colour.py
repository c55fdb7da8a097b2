"""The colour-naming reward of the vision example (`tandem make-data DIR --kind colours`,
examples/colours.yaml): 1.0 when the reply's first word is the picture's colour."""

from __future__ import annotations

from typing import Any

from tandem.rewards.registry import RewardResult, register_reward

COLOUR_NAMES = ("red", "green", "blue")


def check_colour(ground_truth: Any) -> str | None:
    """The ground truth must be one of COLOUR_NAMES."""
    if ground_truth not in COLOUR_NAMES:
        return f"ground_truth {ground_truth!r} is not one of {list(COLOUR_NAMES)}"
    return None


@register_reward("colour_name", check_colour)
def colour_reward(response_text: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """1.0 when the reply's first word (case and trailing punctuation aside) is ground_truth."""
    words = response_text.strip().lower().split()
    correct = bool(words) and words[0].strip(".,!?") == ground_truth
    return RewardResult(float(correct), {"acc": float(correct)})
