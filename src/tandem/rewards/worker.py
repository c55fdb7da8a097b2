"""The async reward worker (reward.placement=agent_loop with a served reward): each finished
trajectory is queued as its session ends, and one background task scores whatever has queued
in one batched RewardScorer.score() call while generation goes on."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.batch.trajectory import Trajectory
    from tandem.rewards.scorer import RewardScorer


class RewardWorker:
    """score_one() is the agent loop's reward_fn; scoring calls run one at a time, in batches
    of up to max_batch trajectories; busy_s sums their wall time (the step's overlapped reward)."""

    def __init__(self, scorer: "RewardScorer", max_batch: int = 64) -> None:
        self.scorer = scorer
        self.max_batch = max_batch
        self.busy_s = 0.0
        self.batches = 0
        self._queue: list[tuple["Trajectory", asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def score_one(self, trajectory: "Trajectory", row: Any = None) -> tuple[float, dict]:
        """(score, details) of one trajectory once its batch is scored."""
        if row is not None:
            trajectory.metadata.setdefault("row", row)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((trajectory, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="reward-worker")
        await future
        return trajectory.reward, trajectory.reward_extra

    def take_busy_seconds(self) -> float:
        """Seconds spent scoring since the last call (then reset)."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            batch = [(t, f) for t, f in batch if not f.done()]  # a cancelled session's is dropped
            began = time.perf_counter()
            try:
                await self.scorer.score([t for t, _ in batch])
            except Exception as error:  # the scorer fails samples, not calls: a bug, say it there
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            finally:
                self.busy_s += time.perf_counter() - began
                self.batches += 1
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
