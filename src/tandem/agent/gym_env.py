"""Gym-style environments (OpenEnv's `Environment` and `EnvClient` among them) driven by the
tool-calling loop (docs/agent_loops.md, "Environments"). Each session makes its own environment
(`rollout.environment.id` with `rollout.environment.args`), resets it with the row's `env_kwargs`,
shows the first observation as a user message and offers one tool, the environment's action:
each call is a `step`, its observation the tool result (mask 0), and `done` ends the session.
The rewards of the steps add up to `metadata["environment_reward"]`, which the reward scorer
weighs with rollout.environment.reward_weight.

The protocol: `reset(**env_kwargs) -> observation` (or Gymnasium's `(observation, info)`) and
`step(action) -> (observation, reward, done, info)` (or Gymnasium's five-tuple, or an object with
`observation`/`reward`/`done` such as OpenEnv's StepResult, or an observation with `reward` and
`done` such as OpenEnv's Observation); either may be async. The action is the tool call's
arguments: a dict, or the environment's pydantic Action type when it is an OpenEnv `Environment`.
Optional attributes: `action_schema` (the JSON schema of an action), `action_name` (the tool's
name, default "step"), `action_description`, `close()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import typing
from dataclasses import dataclass
from typing import Any

from tandem.agent.chat_format import ChatFormat
from tandem.agent.session import Session, TokenClient
from tandem.agent.tool_loop import ToolAgentLoop
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.user_code import call_user_code, is_coroutine_function, load_object

logger = logging.getLogger(__name__)
TIMEOUT_FIELD = "rollout.multi_turn.tool_timeout_seconds"
OPENENV_FIELDS = {"done", "reward", "metadata"}  # an OpenEnv Observation's bookkeeping


@dataclass
class Episode:
    """What the steps of one session's environment returned so far."""

    reward: float = 0.0
    steps: int = 0
    done: bool = False


def action_type(environment: Any) -> Any:
    """The pydantic Action class of an OpenEnv `Environment[Action, Observation, State]`
    subclass (from its generic parameters), else None."""
    for klass in type(environment).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            arguments = typing.get_args(base)
            if (getattr(origin, "__name__", "") == "Environment" and arguments
                    and hasattr(arguments[0], "model_validate")):
                return arguments[0]
    return None


def action_schema(environment: Any) -> dict[str, Any]:
    """The JSON schema of the action tool's arguments: the environment's `action_schema`, else
    its OpenEnv Action type's (without OpenEnv's `metadata` field), else any object."""
    schema = getattr(environment, "action_schema", None)
    if schema is not None:
        return dict(schema)
    kind = action_type(environment)
    if kind is None:
        return {"type": "object"}
    schema = kind.model_json_schema()
    schema.get("properties", {}).pop("metadata", None)
    return schema


def observation_text(observation: Any) -> str:
    """An observation as the text the model reads: a string as is, an OpenEnv Observation or
    another pydantic model as JSON of its set fields (None and done/reward/metadata left out;
    none left: nothing observed, ""), else JSON."""
    if isinstance(observation, str):
        return observation
    if hasattr(observation, "model_dump"):
        fields = {key: value for key, value in observation.model_dump(mode="json").items()
                  if key not in OPENENV_FIELDS and value is not None}
        return json.dumps(fields, ensure_ascii=False) if fields else ""
    try:
        return json.dumps(observation, ensure_ascii=False)
    except TypeError:
        return str(observation)


def reset_observation(result: Any) -> Any:
    """reset()'s observation: Gymnasium's (observation, info), OpenEnv's StepResult, or itself."""
    if isinstance(result, tuple) and len(result) == 2:
        return result[0]
    if hasattr(result, "observation") and hasattr(result, "done"):
        return result.observation
    return result


def step_outcome(result: Any) -> tuple[Any, float, bool]:
    """(observation, reward, done) of step()'s result (see the module docstring)."""
    if isinstance(result, tuple) and len(result) in (4, 5):
        observation, reward = result[0], result[1]
        done = bool(result[2]) or (len(result) == 5 and bool(result[3]))
    elif hasattr(result, "observation") and hasattr(result, "done"):  # OpenEnv's StepResult
        observation, reward, done = result.observation, result.reward, bool(result.done)
    elif hasattr(result, "done") and hasattr(result, "reward"):  # OpenEnv's Observation
        observation, reward, done = result, result.reward, bool(result.done)
    else:
        raise TypeError(f"step() returned {type(result).__name__}; return (observation, reward, "
                        "done, info), Gymnasium's five-tuple, or an object with reward and done")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise TypeError(f"step() returned reward {reward!r}; a reward is a number")
    return observation, float(reward), done


async def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """A method of the environment on the user-code loop (async) or in a thread (sync)."""
    if is_coroutine_function(method):
        return await method(*args, **kwargs)
    return await asyncio.to_thread(method, *args, **kwargs)


class ActionTool:
    """The environment's action as the one tool of a session: each call is one step, one at a
    time; calls after `done` are error results."""

    def __init__(self, environment: Any, episode: Episode) -> None:
        self.environment = environment
        self.episode = episode
        self.name = str(getattr(environment, "action_name", "step"))
        doc = (type(environment).__doc__ or "").strip().splitlines()
        self.description = str(getattr(environment, "action_description", "")
                               or (doc[0] if doc else "Take an action in the environment"))
        self.parameters = action_schema(environment)
        self._type = action_type(environment)
        self._lock: asyncio.Lock | None = None  # made on the loop the calls run on

    async def execute(self, arguments: dict[str, Any], context: dict[str, Any]) -> ToolResult:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.episode.done:
                return ToolResult("Error: the episode is over; no more actions", ok=False, done=True)
            action = arguments
            if self._type is not None:
                try:
                    action = self._type.model_validate(arguments)
                except ValueError as error:  # pydantic's ValidationError: the model's mistake
                    return ToolResult(f"Error: invalid action: {error}", ok=False)
            observation, reward, done = step_outcome(await _call(self.environment.step, action))
            self.episode.reward += reward
            self.episode.steps += 1
            self.episode.done = done
            return ToolResult(observation_text(observation), ok=True, done=done)


class GymEnvironmentLoop:
    """One environment per session, its action tool called by the tool-calling loop."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 environment_class: Any = None) -> None:
        self.config = config
        self.environment_class = environment_class or load_object(
            config.environment.id, "rollout.environment.id")
        self.tool_loop = ToolAgentLoop(client, chat_format, config, ToolRegistry())

    async def _user_code(self, method: Any, kwargs: dict[str, Any], what: str) -> Any:
        return await call_user_code(method, (), kwargs, name=f"environment {what}",
                                    timeout=self.config.multi_turn.tool_timeout_seconds,
                                    field=TIMEOUT_FIELD)

    async def run(self, session: Session) -> Trajectory:
        """Reset a new environment, run the session against it, close it; the Trajectory carries
        the summed step rewards in metadata["environment_reward"]."""
        row = session.row
        environment = await self._user_code(self.environment_class,
                                            dict(self.config.environment.args), "constructor")
        try:
            env_kwargs = row.raw.get("env_kwargs") or {}
            if not isinstance(env_kwargs, dict):
                raise ValueError(f"row {row.index}: env_kwargs must be a dict of reset() "
                                 f"arguments, got {type(env_kwargs).__name__}")
            async def reset(**kwargs: Any) -> Any:
                return await _call(environment.reset, **kwargs)

            observation = reset_observation(await self._user_code(reset, env_kwargs, "reset()"))
            text = "" if observation is None else observation_text(observation)
            messages = [*row.messages, *([{"role": "user", "content": text}] if text else [])]
            if not messages:
                raise ValueError(f"row {row.index} has no messages and reset() observed nothing; "
                                 "the model needs a prompt")
            episode = Episode()
            trajectory = await self.tool_loop.run(
                session, messages, ToolRegistry([ActionTool(environment, episode)]))
        finally:
            await self._close(environment)
        trajectory.metadata.update(environment_reward=episode.reward,
                                   environment_steps=episode.steps,
                                   environment_done=episode.done)
        return trajectory

    async def _close(self, environment: Any) -> None:
        close = getattr(environment, "close", None)
        if not callable(close):
            return
        async def run_close() -> None:
            await _call(close)

        try:
            await self._user_code(run_close, {}, "close()")
        except Exception as error:  # the episode is recorded; a failing close loses nothing
            logger.warning("rollout.environment: close() failed: %s: %s", type(error).__name__,
                           error)
