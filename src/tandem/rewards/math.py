"""Math answers checked the way the RL anchors check them: HF's math-verify parses the model's
final answer (boxed LaTeX, an expression, GSM8K's `#### n`) and the ground truth, and compares
them symbolically (1/2 == 0.5 == \\frac{1}{2}). Registered for verl's math data sources, so a
math dataset in verl's columns trains without a reward of its own. Needs the `math-verify`
package (the `math` extra); the dataset check names the install when it is missing."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from tandem.extras import install_command
from tandem.rewards.arithmetic import final_answer_text
from tandem.rewards.registry import RewardResult, register_reward

# verl's names for these datasets (its default_compute_score) and the short ones
MATH_SOURCES = ("openai/gsm8k", "gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                "HuggingFaceH4/MATH-500", "math")


def check_math_ground_truth(ground_truth: Any) -> str | None:
    """A ground truth to compare with, and math-verify installed to compare it."""
    if importlib.util.find_spec("math_verify") is None:
        return (f"the math reward needs the math-verify package: "
                f"{install_command('math', 'math-verify>=0.7')}")
    if ground_truth is None or str(ground_truth).strip() == "":
        return ("no ground_truth (give a ground_truth column or reward_model.ground_truth); the "
                "math reward compares the final answer with it")
    return None


def math_reward(response_text: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """1.0 when the final answer equals ground_truth as math-verify compares them, else 0.0.
    GSM8K's full solution (`... #### 72`) counts as its number."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # says once per call: no timeout
    gold_text = str(ground_truth).rsplit("####", 1)[-1].strip()
    if "\\" not in gold_text and "$" not in gold_text:
        gold_text = f"${gold_text}$"  # a plain answer as LaTeX, so "1/2" is a fraction
    # the scorer's reward.timeout_seconds bounds the call: math-verify's own timeouts use
    # SIGALRM, which works in the main thread only
    gold = parse(gold_text, parsing_timeout=None)
    answer = parse(final_answer_text(response_text), parsing_timeout=None)
    correct = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
    return RewardResult(float(correct), {"acc": float(correct)})


for _source in MATH_SOURCES:
    register_reward(_source, check_math_ground_truth)(math_reward)
