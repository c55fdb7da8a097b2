"""Reward functions by data source: `fn(response_text, ground_truth, extra_info) -> RewardResult`.

A function the user registers for a data source wins over the built-in of that name (and says
so once, as a warning), whichever is imported first."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)


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
_USER_SOURCES: set[str] = set()  # data sources whose reward the user registered
_BUILTIN_MODULES = ("tandem.rewards.arithmetic", "tandem.rewards.math", "tandem.rewards.colour")
_BUILTIN_PREFIX = "tandem.rewards."


def register_reward(data_source: str, check: GroundTruthCheck | None = None
                    ) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as the reward of rows whose data_source is `data_source`;
    `check` vets a row's ground_truth when the dataset is loaded."""
    def decorate(fn: RewardFn) -> RewardFn:
        builtin = fn.__module__.startswith(_BUILTIN_PREFIX)
        if builtin and data_source in _USER_SOURCES:
            _warn_replaced(data_source, _REWARDS[data_source])
            return fn
        if not builtin:
            if data_source in _REWARDS and data_source not in _USER_SOURCES:
                _warn_replaced(data_source, fn)
            _USER_SOURCES.add(data_source)
            _CHECKS.pop(data_source, None)  # the built-in's ground-truth rules are not the user's
        _REWARDS[data_source] = fn
        if check is not None:
            _CHECKS[data_source] = check
        return fn
    return decorate


def _warn_replaced(data_source: str, fn: RewardFn) -> None:
    logger.warning("reward for data_source %r: %s.%s replaces tandem's built-in", data_source,
                   fn.__module__, getattr(fn, "__qualname__", fn))


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
                f"{', '.join(_REWARDS)}. Fix the row's data_source, register a reward for it, or "
                "name your own function in reward.custom_function (it scores every row)")
    check = _CHECKS.get(data_source)
    return check(ground_truth) if check is not None else None
