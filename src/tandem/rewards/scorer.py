"""The reward of each trajectory, from the functions users already write (docs/api.md,
"Rewards"): verl's per-sample `compute_score(data_source, solution_str, ground_truth,
extra_info=None)`, TRL's batched `fn(prompts, completions, **columns)`, else tandem's registry
by data_source (weighted by reward.rule_weight), plus served reward models and judges
(RewardScorer.add). They add up with their weights. The user's functions run off the event loop
on copies of their arguments, each call bounded by reward.timeout_seconds (user_code.
call_user_code); a function that raises (SystemExit and the like included), times out or returns
no valid score fails only its samples: reward 0, reward_extra["reward_failed"] = 1.0 (a batched
call that raises is retried one sample at a time).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tandem.config.choices import ConfigError
from tandem.rewards.registry import RewardResult, compute_reward, reward_names
from tandem.user_code import call_user_code

if TYPE_CHECKING:
    from tandem.batch.trajectory import Trajectory
    from tandem.config.schema import RewardConfig

logger = logging.getLogger(__name__)
FAILED = "reward_failed"
FLOAT32_MAX = 3.4028234663852886e38
METRIC_KEYS = ("acc", FAILED)  # details the step logs as metrics (and "reward/<name>")


@dataclass
class RewardFunction:
    """One scoring function: kind "registry" (by data source), "verl" (per sample), "batched"
    (TRL) or "served" (`await fn(trajectories) -> [RewardResult]`: a reward model or judge)."""

    name: str
    fn: Callable[..., Any]
    kind: str
    weight: float = 1.0


class RewardScorer:
    """Scores trajectories with the job's reward functions; never raises for a sample's fault."""

    def __init__(self, functions: Sequence[RewardFunction], timeout_seconds: float = 60.0,
                 decode: Callable[[list[int]], str] | None = None, prompt_key: str = "prompt") -> None:
        """decode(response token ids) -> solution_str for verl functions (verl decodes the whole
        response, tool turns included); without it the final assistant text is used.
        prompt_key: the dataset column batched functions get as `prompts` (data.prompt_key)."""
        self.functions = list(functions)  # may start empty when served ones join (add())
        self.timeout_seconds = timeout_seconds
        self.decode = decode
        self.prompt_key = prompt_key
        self._said_replaced: set[str] = set()

    @classmethod
    def from_config(cls, config: "RewardConfig", reward_fn: Callable | None = None,
                    reward_funcs: Sequence[Callable] = (),
                    decode: Callable[[list[int]], str] | None = None,
                    prompt_key: str = "prompt") -> "RewardScorer":
        """The scorer a job's config and Python arguments describe (see the module docstring)."""
        functions = user_reward_functions(config, reward_fn, reward_funcs)
        if not functions and config.rule_weight:
            functions = [RewardFunction("registry", compute_reward, "registry", config.rule_weight)]
        return cls(functions, config.timeout_seconds, decode, prompt_key)

    def add(self, function: RewardFunction) -> None:
        """One more function in the weighted sum (the fleet's served reward model and judge)."""
        self.functions.append(function)

    @property
    def served(self) -> bool:
        """Whether a served reward model or judge scores (their calls wait on other processes)."""
        return any(f.kind == "served" for f in self.functions)

    @property
    def uses_registry(self) -> bool:
        """Whether rows are scored by data_source (so each row's data_source must be known)."""
        return any(f.kind == "registry" for f in self.functions)

    async def score_one(self, trajectory: "Trajectory", row: Any = None) -> tuple[float, dict]:
        """(score, details) of one trajectory: the agent loop's reward_fn."""
        if row is not None:
            trajectory.metadata.setdefault("row", row)
        await self.score([trajectory])
        return trajectory.reward, trajectory.reward_extra

    async def score(self, trajectories: Sequence["Trajectory"]) -> None:
        """Set reward and reward_extra of every trajectory (weighted sum of the functions)."""
        if not trajectories:
            return
        if not self.functions:
            raise RuntimeError("no reward function: give one (reward.custom_function, "
                               "reward.reward_funcs), keep reward.rule_weight > 0, or enable "
                               "reward.model / reward.judge")
        totals = [0.0] * len(trajectories)
        extras: list[dict[str, Any]] = [{} for _ in trajectories]
        for function in self.functions:
            results = await self._run(function, trajectories)
            for index, result in enumerate(results):
                if result is None or result.extra.get(FAILED):
                    extras[index].update(result.extra if result is not None else {})
                    extras[index][FAILED] = 1.0
                    continue
                totals[index] += function.weight * result.score
                extras[index].update(result.extra)
                if len(self.functions) > 1:
                    extras[index][f"reward/{function.name}"] = result.score
        for trajectory, total, extra in zip(trajectories, totals, extras):
            trajectory.reward = 0.0 if extra.get(FAILED) else total
            trajectory.reward_extra = extra

    async def _run(self, function: RewardFunction, trajectories: Sequence["Trajectory"]
                   ) -> list[RewardResult | None]:
        if function.kind == "served":  # fails its own samples, never raises for one
            return list(await function.fn(trajectories))
        if function.kind == "batched":
            try:
                return await self._batched(function, trajectories)
            except Exception as error:
                if len(trajectories) == 1:
                    self._log_failure(function, trajectories[0], error)
                    return [None]
            return [(await self._run(function, [t]))[0] for t in trajectories]
        return list(await asyncio.gather(*(self._per_sample(function, t) for t in trajectories)))

    async def _per_sample(self, function: RewardFunction, trajectory: "Trajectory"
                          ) -> RewardResult | None:
        try:
            if function.kind == "registry":
                value = await self._call(function, trajectory.data_source,
                                         trajectory.metadata.get("response_text", ""),
                                         trajectory.ground_truth,
                                         trajectory.metadata.get("extra_info") or {})
            else:
                self._say_replaced(function, trajectory.data_source)
                value = await self._call(function, data_source=trajectory.data_source,
                                         solution_str=self._solution_str(trajectory),
                                         ground_truth=trajectory.ground_truth,
                                         extra_info=trajectory.metadata.get("extra_info") or {})
            return to_result(value, function.name)
        except Exception as error:  # the sample fails, the batch goes on
            self._log_failure(function, trajectory, error)
            return None

    async def _batched(self, function: RewardFunction, trajectories: Sequence["Trajectory"]
                       ) -> list[RewardResult | None]:
        prompts, completions, columns = batched_inputs(trajectories, self.prompt_key)
        values = await self._call(function, prompts, completions, **columns)
        if not isinstance(values, (list, tuple)) or len(values) != len(trajectories):
            raise ValueError(f"reward function {function.name} returned {type(values).__name__} "
                             f"of length {len(values) if hasattr(values, '__len__') else '?'}; "
                             f"a batched reward returns one float per completion "
                             f"({len(trajectories)})")
        return [RewardResult(0.0) if value is None else to_result(value, function.name)
                for value in values]

    async def _call(self, function: RewardFunction, *args: Any, **kwargs: Any) -> Any:
        return await call_user_code(function.fn, args, kwargs, name=f"reward function {function.name}",
                                    timeout=self.timeout_seconds, field="reward.timeout_seconds")

    def _solution_str(self, trajectory: "Trajectory") -> str:
        if self.decode is None:
            return trajectory.metadata.get("response_text", "")
        policy = trajectory.responses.tolist()
        return self.decode(policy)

    def _say_replaced(self, function: RewardFunction, data_source: str) -> None:
        if data_source in self._said_replaced or data_source not in reward_names():
            return
        self._said_replaced.add(data_source)
        logger.warning("data_source %r: your reward %s scores these rows instead of tandem's "
                       "built-in", data_source, function.name)

    @staticmethod
    def _log_failure(function: RewardFunction, trajectory: "Trajectory", error: Exception) -> None:
        logger.warning("reward %s failed for %s/%s (reward 0): %s: %s", function.name,
                       trajectory.uid, trajectory.session_id, type(error).__name__, error)


def to_result(value: Any, name: str) -> RewardResult:
    """A function's return value (a number, RewardResult, or verl's dict with "score") as a
    RewardResult: numpy and torch scalars become floats, in the score and the details. A score
    that is no number or beyond float32, or a metric detail ("acc") that is no number, is a
    ValueError / TypeError naming the function and the key."""
    if isinstance(value, RewardResult):
        score, extra = value.score, value.extra
    elif isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function {name} returned a dict without 'score' "
                             f"(keys {sorted(value)}); return a float or {{'score': ..., ...}}")
        score, extra = value["score"], {k: v for k, v in value.items() if k != "score"}
    elif isinstance(value, bool) or as_number(value) is None:
        raise TypeError(f"reward function {name} returned {type(value).__name__}; return a float, "
                        "a dict with 'score' or a RewardResult")
    else:
        score, extra = value, {}
    score_number = as_number(score)
    if score_number is None:
        raise TypeError(f"reward function {name} returned score {score!r} "
                        f"({type(score).__name__}); the score is a number")
    if not abs(score_number) <= FLOAT32_MAX:
        raise ValueError(f"reward function {name} returned score {score_number}, non-finite "
                         f"or beyond float32's range (|score| <= {FLOAT32_MAX:.3g}); the "
                         "batch holds rewards as float32")
    details = {}
    for key, detail in extra.items():
        number = as_number(detail)
        metric = key in METRIC_KEYS or key.startswith("reward/")
        if metric and (number is None or not math.isfinite(number)):
            raise ValueError(f"reward function {name} returned detail {key!r}={detail!r} "
                             f"({type(detail).__name__}); {key!r} is logged as a metric, so it "
                             "is a finite number (e.g. 1.0 / 0.0); put text under another key")
        details[key] = detail if number is None else number
    return RewardResult(score_number, details)


def as_number(value: Any) -> float | None:
    """value as a float when it is a real number (bool, int, float, or a one-element numpy /
    torch value), else None."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            value = item()
        except (TypeError, ValueError, RuntimeError):  # more than one element
            return None
        if isinstance(value, (bool, int, float)):
            return float(value)
    return None


def batched_inputs(trajectories: Sequence["Trajectory"], prompt_key: str = "prompt"
                   ) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """TRL's (prompts, completions, columns) of trajectories: chat messages, and each dataset
    column other than the prompt as one list (plus completion_ids, the policy's token ids)."""
    prompts, completions, rows = [], [], []
    for trajectory in trajectories:
        row = trajectory.metadata.get("row")
        messages = trajectory.metadata.get("messages") or []
        prompt = list(row.messages) if row is not None else []
        prompts.append(prompt)
        completions.append(messages[len(prompt):] or [
            {"role": "assistant", "content": trajectory.metadata.get("response_text", "")}])
        rows.append(row)
    names = {key for row in rows if row is not None for key in row.raw} - {prompt_key}
    columns = {name: [row.raw.get(name) if row is not None else None for row in rows]
               for name in sorted(names)}
    columns.setdefault("ground_truth", [t.ground_truth for t in trajectories])
    columns.setdefault("data_source", [t.data_source for t in trajectories])
    columns["completion_ids"] = [
        [int(token) for token, mask in zip(t.responses.tolist(), t.response_mask.tolist()) if mask]
        for t in trajectories]
    return prompts, completions, columns


def user_reward_functions(config: "RewardConfig", reward_fn: Callable | None = None,
                          reward_funcs: Sequence[Callable] = ()) -> list[RewardFunction]:
    """The user's functions in order (custom function, then batched ones) with reward.weights;
    a bad entry or a weights list of the wrong length is a ConfigError naming the field."""
    from tandem.user_code import UserCodeError, load_object

    functions: list[RewardFunction] = []
    custom = config.custom_function
    if reward_fn is not None and custom.path:
        raise ConfigError("reward.custom_function.path is set and Trainer(reward_fn=...) was given: "
                          "name one per-sample reward function, not two")
    try:
        if custom.path:
            entry = f"{custom.path}:{custom.name}"
            reward_fn = load_object(entry, "reward.custom_function")
        batched = [load_object(entry, "reward.reward_funcs") for entry in config.reward_funcs]
    except UserCodeError as error:
        raise ConfigError(str(error)) from None
    if reward_fn is not None:
        functions.append(RewardFunction(_name(reward_fn), _callable(reward_fn, "reward_fn"), "verl"))
    for fn in [*batched, *reward_funcs]:
        functions.append(RewardFunction(_name(fn), _callable(fn, "reward_funcs"), "batched"))
    if config.weights:
        if len(config.weights) != len(functions):
            raise ConfigError(f"reward.weights has {len(config.weights)} entries but there are "
                              f"{len(functions)} reward functions ({', '.join(f.name for f in functions) or 'none'}); "
                              "give one weight per function (custom function first, then reward_funcs)")
        for function, weight in zip(functions, config.weights):
            function.weight = float(weight)
    return functions


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _callable(fn: Any, field: str) -> Callable:
    if not callable(fn):
        raise ConfigError(f"{field}: {fn!r} is not callable; give a function")
    return fn
