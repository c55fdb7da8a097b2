"""The rollout buffer of the async modes (the seed's TransferQueue role, §6.1).

Agent loops put whole prompt groups (all n sessions of one prompt) into it as they finish; the
trainer takes groups for an update. Its capacity counts groups queued *or still generating*:
the producer reserves a slot before it submits a prompt, so a full buffer holds submission
back (back-pressure) and at most `capacity` groups are ever in flight or waiting.

Staleness: a group's lag is (trainer version - the oldest weight version of any of its tokens).
`take` never returns a group whose lag exceeds max_staleness; such a group is dropped or handed
back for regeneration, and counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from tandem.agent.dataset import DatasetRow
from tandem.batch.trajectory import Trajectory
from tandem.trainer.step_metrics import token_lag_metrics

STALE_POLICIES = ("drop", "regenerate")


@dataclass
class RolloutGroup:
    """All sessions of one prompt, finished, with the version the trainer had at submission."""

    row: DatasetRow
    trajectories: list[Trajectory]
    submitted_version: int
    finished_at: float = field(default_factory=time.monotonic)

    @property
    def min_version(self) -> int:
        """The oldest weight version that produced any token of the group."""
        return min(t.min_global_steps for t in self.trajectories)

    @property
    def max_version(self) -> int:
        """The newest weight version that produced any token of the group."""
        return max(t.max_global_steps for t in self.trajectories)

    def lag(self, version: int) -> int:
        """Staleness against trainer version `version`."""
        return version - self.min_version


class StalenessError(RuntimeError):
    """A trajectory older than max_staleness reached an update (a bug in the caller)."""


def check_staleness(trajectories: list[Trajectory], version: int, max_staleness: int) -> None:
    """Raise StalenessError if any token of any trajectory is more than max_staleness versions old."""
    for trajectory in trajectories:
        if version - trajectory.min_global_steps > max_staleness:
            raise StalenessError(
                f"trajectory {trajectory.uid}/{trajectory.session_id} has tokens of version "
                f"{trajectory.min_global_steps}, {version - trajectory.min_global_steps} behind the "
                f"trainer's {version} (max_staleness={max_staleness})")


class RolloutBuffer:
    """Bounded FIFO of finished prompt groups between the producer and the trainer."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"rollout buffer capacity {capacity}: must be >= 1")
        self.capacity = capacity
        self._slots = asyncio.Semaphore(capacity)
        self._ready: deque[RolloutGroup] = deque()
        self._arrived = asyncio.Event()
        self.in_flight = 0
        self.counts: Counter[str] = Counter()  # put, taken, dropped, regenerated, failed

    @property
    def depth(self) -> int:
        """Finished groups waiting for the trainer."""
        return len(self._ready)

    async def reserve(self) -> None:
        """Take a slot before submitting a prompt; waits while the buffer is full."""
        await self._slots.acquire()
        self.in_flight += 1

    def put(self, group: RolloutGroup) -> None:
        """A reserved group finished: queue it for the trainer."""
        self.in_flight -= 1
        self._ready.append(group)
        self.counts["put"] += 1
        self._arrived.set()

    def cancel(self, failed: bool = False) -> None:
        """A reserved group will never arrive (it failed or was cancelled): free its slot."""
        self.in_flight -= 1
        self.counts["failed" if failed else "cancelled"] += 1
        self._slots.release()

    async def take(self, count: int, version: int, max_staleness: int,
                   on_stale: str = "drop") -> tuple[list[RolloutGroup], list[RolloutGroup], dict[str, float]]:
        """Wait for `count` groups within max_staleness of `version`, oldest first.

        Returns (taken, stale, metrics): `stale` are the groups over the bound, already counted
        as dropped or regenerated (the caller resubmits the latter's rows); metrics include the
        group lags and the taken groups' token lags (step_metrics.token_lag_metrics).
        """
        if on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale={on_stale!r}: choose one of {STALE_POLICIES}")
        if count > self.capacity:
            raise ValueError(f"taking {count} groups from a buffer of capacity {self.capacity} "
                             "would wait forever; raise the capacity")
        started = time.monotonic()
        depth_at_call = self.depth
        popped: list[RolloutGroup] = []
        fresh = 0
        try:
            while fresh < count:
                while not self._ready:
                    self._arrived.clear()
                    await self._arrived.wait()
                popped.append(self._ready.popleft())
                fresh += popped[-1].lag(version) <= max_staleness
        except asyncio.CancelledError:
            self._ready.extendleft(reversed(popped))  # a cancelled take loses nothing
            raise
        for _ in popped:
            self._slots.release()
        taken = [g for g in popped if g.lag(version) <= max_staleness]
        stale = [g for g in popped if g.lag(version) > max_staleness]
        self.counts["taken"] += len(taken)
        self.counts["dropped" if on_stale == "drop" else "regenerated"] += len(stale)
        now = time.monotonic()
        lags = Counter(group.lag(version) for group in taken)
        metrics = {
            "buffer/wait_seconds": now - started,
            "buffer/depth": float(depth_at_call),
            "buffer/in_flight": float(self.in_flight),
            "buffer/age_seconds_mean": sum(now - g.finished_at for g in taken) / count,
            "staleness/lag_mean": sum(lag * n for lag, n in lags.items()) / count,
            "staleness/lag_max": float(max(lags)),
            "staleness/stale_groups": float(len(stale)),
            "staleness/dropped_total": float(self.counts["dropped"]),
            "staleness/regenerated_total": float(self.counts["regenerated"]),
        }
        for lag, n in sorted(lags.items()):
            metrics[f"staleness/lag_{lag}_fraction"] = n / count
        metrics.update(token_lag_metrics([t for g in taken for t in g.trajectories], version))
        return taken, stale, metrics
