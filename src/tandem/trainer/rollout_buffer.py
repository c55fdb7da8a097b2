"""The rollout buffer of the async modes (the seed's TransferQueue role, §6.1; docs/trainer.md,
"Rollout buffer"): whole prompt groups in as they finish, groups for an update out. Its capacity
counts groups queued *or still generating* (the producer reserves a slot before it submits a
prompt), so a full buffer holds submission back. on_stale=wait bounds staleness at admission
(trainer/admission.py), dropping nothing; on_stale=drop | regenerate discard or redraw a group
over the bound when it is taken, which biases updates against long answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from tandem.agent.dataset import DatasetRow
from tandem.batch.trajectory import Trajectory
from tandem.config.choices import STALE_POLICIES
from tandem.config.schema import AsyncRolloutConfig
from tandem.trainer.admission import AdmissionSchedule
from tandem.trainer.step_metrics import token_lag_metrics


@dataclass
class RolloutGroup:
    """All sessions of one prompt, finished, with the head version it was admitted at (the
    version the engines served when it started; its tokens are of that version or newer)."""

    row: DatasetRow
    trajectories: list[Trajectory]
    admitted_version: int
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

    @property
    def version_spread(self) -> int:
        """How many syncs the group's generation spanned (newest - oldest token version)."""
        return self.max_version - self.min_version


class StalenessError(RuntimeError):
    """A trajectory whose head is more than max_staleness versions old reached an update (a bug
    in the caller, or a server that a weight sync left behind)."""


def check_staleness(trajectories: list[Trajectory], version: int, max_staleness: int) -> None:
    """Raise StalenessError if any trajectory's head (its oldest token's version) is more than
    max_staleness versions behind `version`."""
    for trajectory in trajectories:
        if version - trajectory.min_global_steps > max_staleness:
            raise StalenessError(
                f"trajectory {trajectory.uid}/{trajectory.session_id} has tokens of version "
                f"{trajectory.min_global_steps}, {version - trajectory.min_global_steps} behind the "
                f"trainer's {version} (max_staleness={max_staleness})")


def default_capacity(train_batch_size: int, max_staleness: int) -> int:
    """Groups generating or waiting at once when trainer.async_rollout.buffer_groups is 0: three
    batches, or fewer where the bound would let no more train in time."""
    return min(3, max_staleness + 1) * train_batch_size


def make_buffer(policy: AsyncRolloutConfig, train_batch_size: int, version: int) -> "RolloutBuffer":
    """The buffer trainer.async_rollout describes, starting at trainer version `version`."""
    capacity = policy.buffer_groups or default_capacity(train_batch_size, policy.max_staleness)
    return RolloutBuffer(capacity, policy.max_staleness, policy.on_stale, train_batch_size, version)


class RolloutBuffer:
    """Bounded queue of finished prompt groups between the producer and the trainer; under
    on_stale=wait it also admits groups by the staleness schedule."""

    def __init__(self, capacity: int, max_staleness: int = 1, on_stale: str = "wait",
                 groups_per_version: int = 1, version: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"rollout buffer capacity {capacity}: must be >= 1")
        if on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale={on_stale!r}: choose one of {STALE_POLICIES}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.schedule = (AdmissionSchedule(groups_per_version, max_staleness, version)
                         if on_stale == "wait" else None)
        self.served_version = version  # the version new generation starts at
        self._slots = asyncio.Semaphore(capacity)
        self._ready: deque[RolloutGroup] = deque()
        self._arrived = asyncio.Event()
        self._admissible = asyncio.Event()
        self.in_flight = 0
        self.admission_wait_s = 0.0  # producer time held by the staleness bound, since last take
        self.error: BaseException | None = None  # the producer's, raised to the trainer (fail)
        # put, taken, dropped, regenerated, failed, cancelled, filtered
        self.counts: Counter[str] = Counter()

    @property
    def depth(self) -> int:
        """Finished groups waiting for the trainer."""
        return len(self._ready)

    def serving(self, version: int) -> None:
        """The engines now serve `version` (a sync finished): groups admitted from now on start
        there, and the bound admits that version's groups."""
        self.served_version = version
        self._admissible.set()

    async def reserve(self) -> int:
        """Take a slot before submitting a prompt; waits while the buffer is full or (on_stale=
        wait) while the group could not train within the bound. Returns its head version."""
        await self._slots.acquire()
        try:
            started = time.monotonic()
            while self.schedule is not None and not self.schedule.can_admit(self.served_version):
                self._admissible.clear()
                await self._admissible.wait()
            self.admission_wait_s += time.monotonic() - started
        except asyncio.CancelledError:
            self._slots.release()
            raise
        if self.schedule is not None:
            self.schedule.admit(self.served_version)
        self.in_flight += 1
        return self.served_version

    def put(self, group: RolloutGroup) -> None:
        """A reserved group finished: queue it for the trainer."""
        self.in_flight -= 1
        self._ready.append(group)
        self.counts["put"] += 1
        self._arrived.set()

    def cancel(self, admitted_version: int, outcome: str = "cancelled") -> None:
        """A group reserved at `admitted_version` will never arrive: it was cancelled, it failed,
        or it was filtered (algorithm.filter_groups: nothing to train on). Its slot and its place
        in the schedule are freed; it is counted under `outcome`, never as taken."""
        if outcome not in ("cancelled", "failed", "filtered"):
            raise ValueError(f"outcome={outcome!r}: cancelled, failed or filtered")
        self.in_flight -= 1
        self.counts[outcome] += 1
        if self.schedule is not None:
            self.schedule.release(admitted_version)
            self._admissible.set()
            self._arrived.set()  # the trainer may have been waiting for this very group
        self._slots.release()

    def fail(self, error: BaseException) -> None:
        """The producer cannot go on (e.g. its reward scoring failed): the trainer's take raises
        `error` instead of waiting for groups that will not come."""
        self.error = error
        self._arrived.set()

    def _next(self) -> RolloutGroup | None:
        if self.schedule is None:
            return self._ready[0] if self._ready else None
        # oldest head first: the groups nearest their deadline; None: wait for one to finish
        for group in sorted(self._ready, key=lambda g: g.admitted_version):
            if self.schedule.can_take(group.admitted_version):
                return group
        return None

    async def take(self, count: int, version: int) -> tuple[list[RolloutGroup], list[RolloutGroup], dict[str, float]]:
        """Wait for `count` groups within max_staleness of trainer version `version`; returns
        (taken, stale, metrics). `stale` (on_stale=drop | regenerate only) are over the bound and
        already counted as dropped or regenerated; on_stale=wait takes the oldest heads first and
        has none."""
        if count > self.capacity:
            raise ValueError(f"taking {count} groups from a buffer of capacity {self.capacity} "
                             "would wait forever; raise the capacity")
        if self.schedule is not None:
            self.schedule.advance(version)
            if count > self.schedule.slots_left:
                raise ValueError(f"taking {count} groups at version {version}, which has "
                                 f"{self.schedule.slots_left} of its groups left")
        started = time.monotonic()
        depth_at_call = self.depth
        popped: list[RolloutGroup] = []
        fresh = 0
        try:
            while fresh < count:
                if self.error is not None:
                    raise self.error
                group = self._next()
                if group is None:
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                self._ready.remove(group)
                popped.append(group)
                if self.schedule is not None:
                    self.schedule.take(group.admitted_version)
                # wait: every group is taken, and the caller's check_staleness raises on a breach
                fresh += self.schedule is not None or group.lag(version) <= self.max_staleness
        except asyncio.CancelledError:
            for group in popped:  # a cancelled take loses nothing
                if self.schedule is not None:
                    self.schedule.untake(group.admitted_version)
            self._ready.extendleft(reversed(popped))
            raise
        for _ in popped:
            self._slots.release()
        self._admissible.set()
        if self.schedule is not None:
            taken, stale = popped, []
        else:
            taken = [g for g in popped if g.lag(version) <= self.max_staleness]
            stale = [g for g in popped if g.lag(version) > self.max_staleness]
        self.counts["taken"] += len(taken)
        self.counts["dropped" if self.on_stale == "drop" else "regenerated"] += len(stale)
        now = time.monotonic()
        lags = Counter(group.lag(version) for group in taken)
        spreads = [group.version_spread for group in taken]
        metrics = {
            "buffer/wait_seconds": now - started,
            "buffer/depth": float(depth_at_call),
            "buffer/in_flight": float(self.in_flight),
            "buffer/age_seconds_mean": sum(now - g.finished_at for g in taken) / count,
            "buffer/admission_wait_seconds": self.admission_wait_s,
            "staleness/lag_mean": sum(lag * n for lag, n in lags.items()) / count,
            "staleness/lag_max": float(max(lags)),
            "staleness/version_spread_mean": sum(spreads) / count,
            "staleness/version_spread_max": float(max(spreads)),
            "staleness/stale_groups": float(len(stale)),
            "staleness/dropped_total": float(self.counts["dropped"]),
            "staleness/regenerated_total": float(self.counts["regenerated"]),
        }
        self.admission_wait_s = 0.0
        for lag, n in sorted(lags.items()):
            metrics[f"staleness/lag_{lag}_fraction"] = n / count
        metrics.update(token_lag_metrics([t for g in taken for t in g.trajectories], version))
        return taken, stale, metrics
