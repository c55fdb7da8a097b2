"""The placed replicas a run owns beside its training workers (the standalone rollout replicas;
the judge's), and the one way a replica started at run time begins to serve: a restart
(fleet/health.py) or the elastic pool growing (docs/serving.md, "Restarts"; docs/trainer.md,
"An elastic pool").

A rollout replica serves only the trainer's current version. One started at run time is loaded
through the weight-sync seam before the balancer sees it: at once when the actor still holds the
version the others serve (no update since the last sync), else right after the next sync, which
the others get first (a newcomer that fails its load cannot fail the trainer's sync). `lock` orders
these joins, the trainer's syncs, the actor's updates and the pool's membership changes, so no
replica joins during a sync or with weights the actor no longer holds. The judge's replicas have
no weight sync (their weights never change): they join at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from tandem.serving.manager import ServerManager
from tandem.serving.replica import RolloutReplica
from tandem.weight_sync.base import WeightSyncError
from tandem.fleet.weight_sync import CrossProcessSync, SyncReport

logger = logging.getLogger(__name__)


class RolloutPool:
    """Members (replica by server id: registered or joining), the version they serve, and add,
    remove and restart paths; `weight_sync` None for servers whose weights never change."""

    def __init__(self, name: str, manager: ServerManager,
                 weight_sync: CrossProcessSync | None) -> None:
        self.name = name  # "rollout" or "judge": in errors and metrics
        self.manager = manager
        self.weight_sync = weight_sync
        self.members: dict[str, RolloutReplica] = dict(manager.replicas)
        self.waiting: list[RolloutReplica] = []  # started; join after the next sync
        self.version: int | None = None if weight_sync else 0  # what registered servers serve
        self.actor_moved = False  # the actor changed since `version` was synced
        self.awaiting_rollout = False  # the trainer waits for data only these servers make
        self.syncs = 0  # syncs and joins so far: a probe that overlapped one may have been slowed
        self.restarting = 0  # members retired and not started again yet
        self.restarts = False  # a health check restarts failed members (rollout.fault_tolerance)
        self.lock = asyncio.Lock()

    @property
    def balancer(self) -> Any:
        return self.manager.balancer

    # -- the trainer's calls -----------------------------------------------------------------

    async def sync(self, version: int) -> SyncReport:
        """The trainer's sync of `version` into every registered replica, then the waiting ones
        join with it. With restarts on, a sync that finds no server left (all died since the
        last) is no error: the restarted ones load `version` when they join."""
        async with self.lock:
            started = time.perf_counter()
            try:
                report = await self.weight_sync.sync(version)
            except WeightSyncError as error:
                if not self.restarts or self.manager.replicas:
                    raise
                logger.warning("%s: no server to sync version %d into (%s); the restarted ones "
                               "load it when they join", self.name, version, error)
                report = SyncReport(version, {"sync/total_s": time.perf_counter() - started}, {})
            self.version, self.actor_moved = version, False
            self.syncs += 1
            waiting, self.waiting = self.waiting, []
            await self._load_and_register(waiting)
        return report

    async def actor_changes(self) -> None:
        """The actor's weights are about to change (an update, a checkpoint load): replicas that
        start from now on wait for the next sync (after a join in progress)."""
        async with self.lock:
            self.actor_moved = True

    # -- membership ----------------------------------------------------------------------------

    def serving(self) -> list[RolloutReplica]:
        """Registered members, in the order they were made."""
        return sorted((r for r in self.members.values() if r.server_id in self.manager.replicas),
                      key=lambda r: r.replica_rank)

    async def add(self, count: int) -> list[str]:
        """Start `count` standalone replicas; each serves the current version before its first
        request. Returns their ids."""
        replicas = await self.manager.start_replicas(count)
        await self.join(replicas)
        return [replica.server_id for replica in replicas]

    def size(self) -> int:
        """Replicas of the pool: members, and those being started again."""
        return len(self.members) + self.restarting

    async def resize(self, replicas: int) -> None:
        """Add or remove replicas until the pool has `replicas` (restarting ones count)."""
        size = self.size()
        if replicas > size:
            logger.info("%s: %d -> %d replicas", self.name, size, replicas)
            await self.add(replicas - size)
        elif replicas < size:
            logger.info("%s: %d -> %d replicas", self.name, size, replicas)
            await self.remove(size - replicas)

    async def remove(self, count: int) -> list[str]:
        """Stop `count` replicas, waiting ones first, then the newest registered; a registered
        one is removed with abort (its requests continue elsewhere with the tokens they have)
        and drained before it shuts down. At least one registered replica stays."""
        async with self.lock:
            serving = self.serving()
            if count < 0 or count - len(self.waiting) > len(serving) - 1:
                raise ValueError(f"{self.name}: cannot remove {count} of {len(self.members)} "
                                 f"replicas ({len(serving)} serving); at least one serving "
                                 "replica stays")
            chosen = (self.waiting[::-1] + serving[::-1])[:count]
            for replica in chosen:
                del self.members[replica.server_id]
                if replica in self.waiting:
                    self.waiting.remove(replica)
                elif replica.server_id in self.manager.replicas:  # not found dead meanwhile
                    await self.manager.remove_replica(replica.server_id, abort=True)
        await self.manager.stop_replicas(chosen)
        return [replica.server_id for replica in chosen]

    async def join(self, replicas: Sequence[RolloutReplica]) -> None:
        """Make started replicas members; each is registered once it serves the current
        version: loaded now if the actor holds it, else right after the next sync."""
        async with self.lock:
            for replica in replicas:
                self.members[replica.server_id] = replica
            if self.weight_sync is not None and (self.version is None or self.actor_moved):
                self.waiting.extend(replicas)
                logger.info("%s: %s wait for the next weight sync (the actor has moved past "
                            "version %s)", self.name, [r.server_id for r in replicas], self.version)
                return
            await self._load_and_register(list(replicas))

    async def _load_and_register(self, replicas: list[RolloutReplica]) -> None:
        """Under the lock: load `version` into `replicas` (the actor holds it) and register the
        ones that serve it; a replica that failed the load waits for the next sync."""
        if not replicas:
            return
        served: dict[str, int | None] = {r.server_id: 0 for r in replicas}
        if self.weight_sync is not None:
            self.syncs += 1
            try:
                served = (await self.weight_sync.sync(self.version, replicas)).served
            except WeightSyncError as error:
                logger.warning("%s: loading version %d into %s failed (%s); they try again after "
                               "the next sync", self.name, self.version,
                               [r.server_id for r in replicas], error)
                served = {}
        for replica in replicas:
            try:
                if served.get(replica.server_id) == self.version:
                    await self.manager.add_replica(replica)
                    continue
            except Exception as error:  # it died right now: the health check finds it waiting
                logger.warning("%s: registering %s failed: %s", self.name, replica.server_id, error)
            self.waiting.append(replica)

    # -- restarts (fleet/health.py) --------------------------------------------------------------

    def joining(self) -> set[str]:
        """Members not registered on purpose (waiting for a version)."""
        return {replica.server_id for replica in self.waiting}

    def changes(self) -> int:
        """Syncs and joins so far (a probe that overlapped one is not trusted to call a stall)."""
        return self.syncs

    def probe_targets(self) -> dict[str, Any]:
        """server_id -> main server of every member (probed by the health check)."""
        return {sid: replica.main_server for sid, replica in self.members.items()
                if replica.servers}

    async def retire(self, server_id: str, stalled: bool) -> RolloutReplica:
        """Under the lock: a member found dead or stalled leaves the pool, the fleet and the
        balancer (counted) and its processes are killed; returns it for start_again()."""
        replica = self.members.pop(server_id)
        if replica in self.waiting:
            self.waiting.remove(replica)
        await self.manager.discard(server_id, stalled)
        replica.kill()
        self.restarting += 1
        return replica

    async def start_again(self, retired: RolloutReplica, server_id: str) -> None:
        """Start `server_id` in the retired replica's placement and let it join (it serves the
        current version before its first request)."""
        again = await retired.start_again(server_id)
        self.restarting -= 1
        await self.join([again])

    def stuck(self) -> str | None:
        """Why the run cannot go on, or None: the trainer waits for data, no server is
        registered, and the replicas that could make it wait for a sync that needs that data."""
        if self.awaiting_rollout and self.waiting and not self.manager.replicas:
            why = (f"the actor has trained past version {self.version}, which they would have to "
                   "serve" if self.actor_moved else "their load failed")
            return (f"no {self.name} server is serving: {[r.server_id for r in self.waiting]} "
                    f"started but can only serve after the next weight sync ({why}), and "
                    "the trainer waits for data that only a server can generate. Run at least two "
                    "standalone replicas (rollout.n_gpus_per_node), or "
                    "trainer.separate_async.parameter_sync_step=1 (the actor then holds the served "
                    "version whenever it waits for data)")
        return None

    async def stop(self) -> None:
        """Shut down the members that are not registered (the manager stops the others)."""
        unregistered = [r for sid, r in self.members.items() if sid not in self.manager.replicas]
        self.waiting = []
        await self.manager.stop_replicas(unregistered)


def scheduled_size(schedule: list[list[int]], step: int) -> int | None:
    """The pool size rollout.elastic.schedule ([[step, replicas], ...]) sets from `step` on:
    that of its last entry at or before `step`; None before the first."""
    sizes = [replicas for at, replicas in schedule if at <= step]
    return sizes[-1] if sizes else None


def pressure_size(size: int, trainer_idle: float, rollout_idle: float, auto: Any,
                  capacity: int) -> int:
    """The pool size rollout.elastic.auto sets after a step with these idle fractions: one more
    when the trainer waited on rollout above grow_above, one fewer when the rollout was held
    back above shrink_above, within [min_replicas, max_replicas or capacity]."""
    high = min(auto.max_replicas or capacity, capacity)
    if trainer_idle > auto.grow_above and size < high:
        return size + 1
    if rollout_idle > auto.shrink_above and size > auto.min_replicas:
        return size - 1
    return min(max(size, auto.min_replicas), high)
