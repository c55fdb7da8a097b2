"""Dataset rows -> n agent-loop sessions each -> Trajectories (seed §6.2).

Each prompt gets n sessions sharing its uid (rollout.n, val_kwargs.n, or the row's rollout_n),
at most rollout.agent_concurrency in flight across all prompts; a session's request id is the
same on every turn, so routing stays sticky. A session that raises fails alone: it is left out
and recorded in `failures`; only a call in which every session fails raises (AllSessionsFailed).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow
from tandem.agent.session import Session, TokenClient
from tandem.agent.single_turn import SingleTurnLoop
from tandem.agent.tool_loop import ToolAgentLoop
from tandem.batch.trajectory import Trajectory, continued_later, share_split_rewards
from tandem.config.schema import RolloutConfig
from tandem.tools.registry import ToolRegistry, build_tool_registry

if TYPE_CHECKING:
    from tandem.agent.gym_env import GymEnvironmentLoop
    from tandem.agent.openai_agent import OpenAIAgentLoop
    from tandem.agent.verifiers_env import VerifiersLoop

RewardOutput = tuple[float, dict[str, Any]]
# reward_fn(trajectory, row) -> (score, extra), or an awaitable of it; called as a session ends.
RewardFn = Callable[[Trajectory, DatasetRow], RewardOutput | Awaitable[RewardOutput]]

logger = logging.getLogger(__name__)


@dataclass
class SessionFailure:
    """A session that raised instead of returning a Trajectory; error is the exception."""

    uid: str
    session_id: int
    error: BaseException


class AllSessionsFailed(RuntimeError):
    """Every session of a run() or run_prompt() call failed; the trainer skips such a step."""

    def __init__(self, message: str, failures: list[SessionFailure]) -> None:
        super().__init__(message)
        self.failures = failures


class AgentLoopRunner:
    """Runs the configured loop over rows: an environment's (rollout.environment.kind),
    openai_agent when rollout.openai_agent.enable, tool-calling when rollout.multi_turn.enable,
    else single-turn."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 tools: ToolRegistry | None = None, reward_fn: RewardFn | None = None) -> None:
        """tools: defaults to the built-ins named in rollout.multi_turn.tools; a registry given
        instead must hold at least those (and may add tools of its own)."""
        if config.agent_concurrency < 1:
            raise ValueError(f"rollout.agent_concurrency={config.agent_concurrency}: must be >= 1")
        self.config = config
        self.reward_fn = reward_fn
        self.loop: SingleTurnLoop | ToolAgentLoop | OpenAIAgentLoop | GymEnvironmentLoop | VerifiersLoop
        if config.environment.kind == "gym":
            from tandem.agent.gym_env import GymEnvironmentLoop

            self.loop = GymEnvironmentLoop(client, chat_format, config)
        elif config.environment.kind == "verifiers":
            from tandem.agent.verifiers_env import VerifiersLoop  # imports verifiers

            self.loop = VerifiersLoop(client, chat_format, config)
        elif config.openai_agent.enable:
            from tandem.agent.openai_agent import OpenAIAgentLoop  # imports fastapi and openai

            self.loop = OpenAIAgentLoop(client, chat_format, config)
        elif config.multi_turn.enable:
            tools = tools if tools is not None else build_tool_registry(config.multi_turn.tools)
            # a given registry must hold the built-ins the config names (user classes are
            # named by import path, not by tool name)
            missing = [name for name in config.multi_turn.tools if ":" not in name and name not in tools]
            if missing:
                raise ValueError(f"rollout.multi_turn.tools lists {missing}, which the given "
                                 f"ToolRegistry lacks (it has {tools.names()})")
            if not len(tools):
                raise ValueError("rollout.multi_turn.enable=true but no tools are registered: list "
                                 "them in rollout.multi_turn.tools (e.g. [calculator]) or pass a "
                                 "ToolRegistry")
            self.loop = ToolAgentLoop(client, chat_format, config, tools)
        else:
            if tools is not None and len(tools):
                raise ValueError("tools were given but rollout.multi_turn.enable=false, so the "
                                 "single-turn loop would ignore them; set "
                                 "rollout.multi_turn.enable=true")
            self.loop = SingleTurnLoop(client, chat_format, config)
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.failures: list[SessionFailure] = []  # every failed session since the last take

    @classmethod
    def from_tokenizer(cls, client: TokenClient, tokenizer: Any, config: RolloutConfig,
                       tools: ToolRegistry | None = None, reward_fn: RewardFn | None = None,
                       stop_token_ids: Sequence[int] = (), image_processor: Any = None
                       ) -> "AgentLoopRunner":
        """A runner rendering with an HF tokenizer's chat template; stop_token_ids end a turn
        besides tokenizer.eos_token_id (e.g. generation_config's extra eos ids);
        image_processor: a vision-language policy's, for rows with images."""
        return cls(client, ChatFormat(tokenizer, stop_token_ids, image_processor), config, tools,
                   reward_fn)

    def sessions_per_prompt(self, row: DatasetRow, validate: bool) -> int:
        """n for this row: its rollout_n, else val_kwargs.n (validation) or rollout.n."""
        if row.rollout_n is not None:
            return row.rollout_n
        return self.config.val_kwargs.n if validate else self.config.n

    def _semaphore(self) -> asyncio.Semaphore:
        # asyncio primitives are bound to one event loop; keep one per loop.
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.config.agent_concurrency)
        return self._semaphores[loop]

    def take_failures(self) -> list[SessionFailure]:
        """The sessions that failed since the last call (they are cleared)."""
        failures, self.failures = self.failures, []
        return failures

    async def close(self) -> None:
        """Release what the loop holds (the openai_agent loop's endpoint)."""
        if hasattr(self.loop, "close"):
            await self.loop.close()

    async def _run_session(self, session: Session,
                           on_trajectory: Callable[[Trajectory], None] | None = None
                           ) -> list[Trajectory] | SessionFailure:
        try:
            return await self._run_session_or_raise(session, on_trajectory)
        except Exception as error:  # one session's fault stays in that session
            logger.warning("session %s failed: %s: %s", session.request_id,
                           type(error).__name__, error)
            failure = SessionFailure(session.row.uid, session.session_id, error)
            self.failures.append(failure)
            return failure

    async def _run_session_or_raise(self, session: Session,
                                    on_trajectory: Callable[[Trajectory], None] | None
                                    ) -> list[Trajectory]:
        async with self._semaphore():
            result = await self.loop.run(session)
            # the openai_agent loop returns every branch of its session
            trajectories = result if isinstance(result, list) else [result]
            for trajectory in trajectories:
                trajectory.metadata.setdefault("row", session.row)  # batched rewards read its columns
                if (self.reward_fn is not None and trajectory.reward is None
                        and not continued_later(trajectory)):
                    scored = self.reward_fn(trajectory, session.row)
                    if inspect.isawaitable(scored):
                        scored = await scored
                    score, extra = scored
                    trajectory.reward = float(score)
                    trajectory.reward_extra = dict(extra)
            share_split_rewards(trajectories)  # a split session's samples share its reward
            if on_trajectory is not None:
                for trajectory in trajectories:
                    on_trajectory(trajectory)
            return trajectories

    async def run_prompt(self, row: DatasetRow, validate: bool = False, seed: int | None = None,
                         on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """The finished sessions of one prompt (one GRPO group), ordered by session_id; failed
        ones are left out (see `failures`), and if all fail, AllSessionsFailed. With a seed, session s
        samples turn t with seed + s * 1000 + t, so a rerun draws the same tokens."""
        return _finished(await self._run_prompt(row, validate, seed, on_trajectory))

    async def _run_prompt(self, row: DatasetRow, validate: bool, seed: int | None,
                          on_trajectory: Callable[[Trajectory], None] | None
                          ) -> list[Trajectory | SessionFailure]:
        if not row.uid:
            raise ValueError(f"row {row.index} has no uid; draw rows from PromptDataset (which "
                             "gives each draw a fresh uid) or set row.uid")
        sessions = [Session(row, session_id, f"{row.uid}-{session_id}", validate,
                            None if seed is None else seed + session_id * 1000)
                    for session_id in range(self.sessions_per_prompt(row, validate))]
        results = await _all_or_nothing([self._run_session(session, on_trajectory)
                                         for session in sessions])
        # the openai_agent loop returns every branch of its session: flatten them
        return [item for result in results
                for item in (result if isinstance(result, list) else [result])]

    async def run(self, rows: Sequence[DatasetRow], validate: bool = False,
                  seeds: Sequence[int] | None = None,
                  on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Every finished session of every row, concurrently; ordered by row, then session_id.
        Failed sessions are left out and recorded in `failures`; if all fail, AllSessionsFailed.
        seeds: one base sampling seed per row (see run_prompt), or None for unseeded sampling;
        on_trajectory: called as each session ends (e.g. a progress bar)."""
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"{len(seeds)} seeds for {len(rows)} rows: give one per row")
        uids = [row.uid for row in rows]
        if len(set(uids)) != len(uids):
            raise ValueError("two rows share a uid; GRPO would merge their groups. Draw each row "
                             "from PromptDataset, which assigns a fresh uid per draw")
        groups = await _all_or_nothing([self._run_prompt(row, validate,
                                                         None if seeds is None else seeds[i],
                                                         on_trajectory)
                                        for i, row in enumerate(rows)])
        return _finished([result for group in groups for result in group])


def _finished(results: list[Trajectory | SessionFailure]) -> list[Trajectory]:
    """The trajectories; AllSessionsFailed (from the first failure) when every session failed."""
    trajectories = [result for result in results if isinstance(result, Trajectory)]
    if results and not trajectories:
        first = results[0]
        raise AllSessionsFailed(f"all {len(results)} sessions failed; the first ({first.uid}-"
                                f"{first.session_id}): {type(first.error).__name__}: "
                                f"{first.error}", list(results)) from first.error
    return trajectories


async def _all_or_nothing(coroutines: list[Awaitable[Any]]) -> list[Any]:
    """gather(), but the first failure cancels the rest and is re-raised as itself."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
