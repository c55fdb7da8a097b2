"""Reward functions by data source: `fn(response_text, ground_truth, extra_info) -> RewardResult`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RewardResult:
    """A scalar outcome score plus per-sample details (logged, never used as a loss)."""

    score: float
    extra: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[str, Any, dict], RewardResult]
# check(ground_truth) -> what is wrong with it for this reward, or None
GroundTruthCheck = Callable[[Any], str | None]
_REWARDS: dict[str, RewardFn] = {}
_CHECKS: dict[str, GroundTruthCheck] = {}
_BUILTIN_MODULES = ("tandem.rewards.arithmetic",)


def register_reward(data_source: str, check: GroundTruthCheck | None = None
                    ) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as the reward of rows whose data_source is `data_source`;
    `check` vets a row's ground_truth when the dataset is loaded."""
    def decorate(fn: RewardFn) -> RewardFn:
        _REWARDS[data_source] = fn
        if check is not None:
            _CHECKS[data_source] = check
        return fn
    return decorate


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def reward_names() -> tuple[str, ...]:
    """Data sources that have a reward function."""
    _load_builtins()
    return tuple(_REWARDS)


def compute_reward(data_source: str, response_text: str, ground_truth: Any,
                   extra_info: dict | None = None) -> RewardResult:
    """Score one response with the function registered for its data source."""
    _load_builtins()
    if data_source not in _REWARDS:
        raise KeyError(f"no reward function for data_source {data_source!r}; registered: "
                       f"{', '.join(_REWARDS)}. Register one with @register_reward({data_source!r}).")
    return _REWARDS[data_source](response_text, ground_truth, extra_info or {})


def reward_input_problem(data_source: str, ground_truth: Any) -> str | None:
    """What keeps a row from being scored (unknown data_source, unusable ground_truth), or None."""
    _load_builtins()
    if data_source not in _REWARDS:
        return (f"no reward function for data_source {data_source!r}; registered: "
                f"{', '.join(_REWARDS)}. Fix the row's data_source or register a reward for it")
    check = _CHECKS.get(data_source)
    return check(ground_truth) if check is not None else None
