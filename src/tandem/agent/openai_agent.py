"""The `openai_agent` loop: a user's agent, written against the official `openai` client, runs
each session; tandem's endpoint records what it samples as token-exact Trajectories.

The agent is `async def run(client: openai.AsyncOpenAI, row: DatasetRow) -> reward_info`,
named by import path (rollout.openai_agent.agent = "package.module:function"). reward_info is
None (the configured reward function scores the trajectories), a float score, or a dict with a
float "score" and any extra fields. The endpoint starts on first use, on the running event loop.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Awaitable, Callable

import openai

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow
from tandem.agent.recorder import ChatRecorder, SessionSettings
from tandem.agent.session import Session, TokenClient
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig
from tandem.rewards.scorer import to_result
from tandem.agent.openai_endpoint import SESSION_HEADER, EndpointServer, create_app

AgentFn = Callable[[openai.AsyncOpenAI, DatasetRow], Awaitable[Any]]


def load_agent(path: str) -> AgentFn:
    """The callable at "package.module:function"."""
    module_name, _, name = path.partition(":")
    try:
        agent = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"rollout.openai_agent.agent={path!r} cannot be imported ({error}); give "
                         "'package.module:function' of an importable module") from None
    if not callable(agent):
        raise ValueError(f"rollout.openai_agent.agent={path!r} is not callable")
    return agent


def _reward(info: Any) -> tuple[float, dict[str, Any]] | None:
    """The agent's own reward, checked like a reward function's (rewards.scorer.to_result: a
    number within float32, metric details numbers); None: the reward functions score."""
    if info is None:
        return None
    result = to_result(info, "the openai agent (its return value; None lets the reward "
                             "functions score)")
    return result.score, result.extra


class OpenAIAgentLoop:
    """Runs one agent call per session against the endpoint and returns its recorded branches."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 agent: AgentFn | None = None) -> None:
        self.config = config
        self.agent = agent or load_agent(config.openai_agent.agent)
        self.recorder = ChatRecorder(client, chat_format, config)
        self._server: EndpointServer | None = None
        self._starting: asyncio.Lock | None = None

    async def base_url(self) -> str:
        """The endpoint's URL, starting it on the running event loop the first time."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None:
                settings = self.config.openai_agent
                app = create_app(self.recorder, settings.served_model_name, settings.api_key,
                                 settings.max_request_bytes)
                server = EndpointServer(app, settings.host, settings.port)
                await server.start()
                self._server = server
        return self._server.base_url

    async def close(self) -> None:
        """Stop the endpoint (a later run starts it again)."""
        if self._server is not None:
            await self._server.stop()
            self._server = None
            self._starting = None

    async def run(self, session: Session) -> list[Trajectory]:
        """One agent run for the session; every branch it recorded, reward set if it gave one."""
        async def play(base_url: str, key: str) -> Any:
            client = openai.AsyncOpenAI(base_url=base_url, max_retries=0,
                                        api_key=self.config.openai_agent.api_key or "none",
                                        default_headers={SESSION_HEADER: key})
            try:
                return await self.agent(client, session.row)
            finally:
                await client.close()

        info, trajectories = await self.record(session, play)
        reward = _reward(info)
        for trajectory in trajectories:
            trajectory.metadata["reward_info"] = info
            if reward is not None:
                trajectory.reward, trajectory.reward_extra = reward[0], dict(reward[1])
        return trajectories

    async def record(self, session: Session, play: Callable[[str, str], Awaitable[Any]]
                     ) -> tuple[Any, list[Trajectory]]:
        """Open the session's recording, await play(base_url, session_key) (calls to base_url
        with the key as X-Session-Id, or to the endpoint's session_url(key), are recorded), close
        it: (what play returned, every branch recorded)."""
        row = session.row
        key = session.request_id
        self.recorder.open(key, SessionSettings(
            uid=row.uid, session_id=session.session_id, seed=session.seed,
            validate=session.validate, do_sample=row.do_sample, data_source=row.data_source,
            ground_truth=row.ground_truth, extra_info=row.extra_info))
        try:
            info = await play(await self.base_url(), key)
        finally:
            trajectories = self.recorder.close(key)
        if not trajectories:
            raise ValueError(f"the agent made no successful chat call for session {key!r}; it "
                             "must call the chat completions endpoint at least once")
        return info, trajectories

    def session_url(self, key: str) -> str:
        """The endpoint's base_url for session `key` (see EndpointServer.session_url); the
        endpoint runs (base_url() started it)."""
        if self._server is None:
            raise RuntimeError("the endpoint is not running; await base_url() first")
        return self._server.session_url(key)
