"""`verifiers` environments as agent loops (docs/agent_loops.md, "Environments"): each session is
one episode of a verifiers (>= 0.4, `verifiers.v1`) environment, loaded by its id
(rollout.environment.id, an installed taskset package) with its arguments (rollout.environment.
args, the taskset's config fields). The episode's harness talks to an OpenAI-compatible client
whose base URL is tandem's token-recording endpoint, one URL per session, so every model call is
recorded token-exact (agent/recorder.py: forks and splits included) while verifiers runs its
own harness, tools and interception. The task is the one the row names in its `task` column (an
index into the taskset, or a task id or name); the episode's rubric total becomes
metadata["environment_reward"] of every sample of the session, weighed by the reward scorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from tandem.agent.chat_format import ChatFormat
from tandem.agent.openai_agent import OpenAIAgentLoop
from tandem.agent.session import Session, TokenClient
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig

API_KEY_VAR = "TANDEM_ENDPOINT_API_KEY"  # verifiers reads a client's key from an env var
INSTALL = ("pip install 'verifiers==0.4.0' (it needs openai<3; make verifiers puts it beside "
           ".venv without changing .venv's pins)")


def load_verifiers_environment(config: RolloutConfig) -> Any:
    """The verifiers Env rollout.environment names, its agent on the local subprocess runtime
    unless the harness config says otherwise."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError(f"rollout.environment.kind=verifiers needs the verifiers package "
                          f"({error}); {INSTALL}") from None
    environment = config.environment
    agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}
    if environment.harness:
        agent["harness"] = dict(environment.harness)
    try:
        env_config = vf.resolve_env_config({"taskset": {"id": environment.id, **environment.args},
                                            "agent": agent})
        return vf.load_environment(env_config)
    except (ImportError, ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"rollout.environment.id={environment.id!r}: verifiers cannot load it "
                         f"with rollout.environment.args={dict(environment.args)}: "
                         f"{type(error).__name__}: {error}") from None


class VerifiersLoop:
    """One verifiers episode per session, recorded through tandem's endpoint."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 environment: Any = None) -> None:
        self.config = config
        self.environment = environment or load_verifiers_environment(config)
        self.tasks = list(self.environment.taskset)  # a bounded taskset: rows name its tasks
        if not self.tasks:
            raise ValueError(f"rollout.environment.id={config.environment.id!r}: the taskset "
                             "yields no task")
        self.endpoint = OpenAIAgentLoop(client, chat_format, config, agent=_unused)
        if config.openai_agent.api_key:  # the endpoint requires it of every call
            os.environ[API_KEY_VAR] = config.openai_agent.api_key
        self._serving: contextlib.AbstractAsyncContextManager | None = None
        self._starting: asyncio.Lock | None = None

    def task(self, row: Any) -> Any:
        """The task the row's `task` column names: an index, or a task's id or name."""
        wanted = row.raw.get("task")
        if wanted is None:
            raise ValueError(f"row {row.index} has no `task` column; name the environment's task "
                             f"by index (0..{len(self.tasks) - 1}), id or name")
        if isinstance(wanted, int) and not isinstance(wanted, bool):
            if 0 <= wanted < len(self.tasks):
                return self.tasks[wanted]
        else:
            for task in self.tasks:
                if wanted in (task.data.id, task.data.name):
                    return task
        raise ValueError(f"row {row.index}: task {wanted!r} is not a task of "
                         f"{self.config.environment.id!r} (indices 0..{len(self.tasks) - 1}, or "
                         "a task's id or name)")

    async def _serve(self) -> None:
        """Enter the environment's serving context (its interception server) once."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._serving is None:
                serving = self.environment.serving()
                await serving.__aenter__()
                self._serving = serving

    async def close(self) -> None:
        """Leave the environment's serving context and stop the endpoint."""
        if self._serving is not None:
            serving, self._serving, self._starting = self._serving, None, None
            await serving.__aexit__(None, None, None)
        await self.endpoint.close()

    async def run(self, session: Session) -> list[Trajectory]:
        """The session's episode; every sample it recorded, the rubric's total in
        metadata["environment_reward"]."""
        import verifiers.v1 as vf

        task = self.task(session.row)
        await self._serve()
        settings = self.config.openai_agent

        async def play(base_url: str, key: str) -> Any:
            client = vf.EvalClientConfig(base_url=self.endpoint.session_url(key),
                                         api_key_var=API_KEY_VAR)
            context = vf.ModelContext(model=settings.served_model_name, client=client)
            return await self.environment.run_episode(task, context)

        episode, trajectories = await self.endpoint.record(session, play)
        if not episode.ok:
            errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "no trace ok"
            raise RuntimeError(f"the verifiers episode of task {task.data.idx} failed: {errors}")
        reward = sum(trace.reward for trace in episode.traces)
        rewards = {name: value.value for trace in episode.traces
                   for name, value in trace.rewards.items() if value is not None}
        for trajectory in trajectories:
            trajectory.metadata.update(environment_reward=reward, environment_rewards=rewards,
                                       environment_task=task.data.idx)
        return trajectories


async def _unused(client: Any, row: Any) -> None:
    raise RuntimeError("the verifiers loop plays its episodes itself")
