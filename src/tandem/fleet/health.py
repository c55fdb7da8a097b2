"""The fleet's health check (rollout.fault_tolerance; docs/serving.md, "Restarts"): every
health_interval_s it asks each server of the watched pools (standalone rollout replicas, the
judge's, the reward model's) for weight_version(). A server that is dead, stalled (no answer
within 3 x health_interval_s: SIGSTOPped, wedged) or already taken out by a client or a control
call is retired (out of the balancer, killed) and started again in its placement, where it joins
as the pool says (a rollout replica serves the trainer's current version first). Its requests
were already continued elsewhere by the clients, or wait for it when no server is left.

Past rollout.fault_tolerance.max_restarts restarts, or when no server can serve before the data
the trainer waits for exists, the check fails the run: `failure` names the server, what happened
and the fix, and `unless_failed()` raises it into the trainer's waits.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Protocol, TypeVar

from tandem.config.schema import FaultToleranceConfig
from tandem.serving.client import DEAD_SERVER_ERRORS
from tandem.serving.remote import NoAnswerError, call

logger = logging.getLogger(__name__)
T = TypeVar("T")
PROBES_PER_STALL = 3  # a server answering no probe within 3 x health_interval_s is stalled


class ServerRestartError(RuntimeError):
    """The fleet could not bring a server back: the restart budget is spent, or no server can
    serve before the data the trainer waits for exists."""


class RestartablePool(Protocol):
    """What the health check needs of a pool (fleet/rollout_pool.py, serving/reward_pool.py)."""

    name: str
    balancer: Any
    lock: asyncio.Lock  # held while the check takes a server out, so no join overlaps it

    def probe_targets(self) -> dict[str, Any]:
        """server_id -> the server to probe, of every member."""

    def joining(self) -> set[str]:
        """Members not registered in the balancer on purpose."""

    def changes(self) -> int:
        """A counter of weight loads: a probe that overlapped one may have been slowed by it."""

    async def retire(self, server_id: str, stalled: bool) -> Any:
        """Take a failed member out (balancer, pool) and kill it; returns what start_again takes."""

    async def start_again(self, retired: Any, server_id: str) -> None:
        """Start `server_id` in the retired one's place; it joins as the pool says."""


@dataclass
class Restart:
    """A server taken out, to be started again."""

    pool: RestartablePool
    retired: Any
    server_id: str  # the one that failed
    reason: str
    next_id: str  # what the next start is called (clients wait for it: balancer.expect)
    attempts: int = 0


class FleetHealth:
    """The background check of one run; `restarts` counts servers started again."""

    def __init__(self, config: FaultToleranceConfig, pools: list[RestartablePool]) -> None:
        self.config = config
        self.pools = pools
        self.restarts = 0
        self.failure: ServerRestartError | None = None
        self._failed = asyncio.Event()
        self._pending: list[Restart] = []
        self._reported = 0  # restarts already in a step's metrics
        self._starts: Counter[str] = Counter()  # original id -> starts again (names the next)
        self._task: asyncio.Task | None = None

    @property
    def probe_timeout_s(self) -> float:
        return PROBES_PER_STALL * self.config.health_interval_s

    async def start(self) -> None:
        """Tell the pools' balancers that dead servers come back, and begin checking."""
        for pool in self.pools:
            await call(pool.balancer, "restart_dead")
        self._task = asyncio.create_task(self._watch(), name="fleet-health")

    async def stop(self) -> None:
        """End the check (a restart in progress is cancelled) and free what retired servers
        still hold (their placement groups)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for restart in self._pending:
            release = getattr(restart.retired, "release", None)  # a rollout replica's group
            if release is not None:
                release()
        self._pending = []

    def metrics(self) -> dict[str, float]:
        """fleet/restarts (since the last call: the step's) and fleet/restarts_total."""
        step, self._reported = self.restarts - self._reported, self.restarts
        return {"fleet/restarts": float(step), "fleet/restarts_total": float(self.restarts)}

    def raise_if_failed(self) -> None:
        """Raise the failure that ended the check, if any."""
        if self.failure is not None:
            raise self.failure

    async def unless_failed(self, work: Awaitable[T]) -> T:
        """Await `work` unless the check fails first: then cancel it and raise the failure."""
        if self.failure is not None:
            if asyncio.iscoroutine(work):
                work.close()  # never started: no "never awaited" warning
            raise self.failure
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            self.raise_if_failed()
        return task.result()

    # -- the check ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check()
            except ServerRestartError as error:
                await self._fail(error)
                return
            except Exception as error:  # a bug here must end the run, not the checking
                logger.exception("the fleet's health check failed")
                await self._fail(ServerRestartError(
                    f"the fleet's health check failed: {type(error).__name__}: {error}"))
                return

    async def check(self) -> None:
        """One round: find failed servers, retire them, start every retired one again (within
        the budget); ServerRestartError when the run cannot go on."""
        for pool in self.pools:
            await self._find_failures(pool)
        for restart in list(self._pending):
            await self._start_again(restart)
        for pool in self.pools:
            stuck = getattr(pool, "stuck", lambda: None)()
            if stuck:
                raise ServerRestartError(f"{stuck} (rollout.fault_tolerance)")

    async def _find_failures(self, pool: RestartablePool) -> None:
        before = pool.changes()
        verdicts = await _probe_all(pool.probe_targets(), self.probe_timeout_s)
        async with pool.lock:  # decided with no join or sync under way
            status = await call(pool.balancer, "status")
            registered = {load.server_id for load in status.servers}
            joining = pool.joining()
            for server_id in list(pool.probe_targets()):
                if server_id not in joining and server_id not in registered:
                    stalled = server_id in status.stalled_servers
                    reason = ("stalled (a client's probe got no answer)" if stalled else
                              "died (a request or a control call found its process gone)")
                elif server_id in verdicts:
                    reason, stalled = verdicts[server_id]
                    if stalled and pool.changes() != before:
                        continue  # a weight load overlapped the probe: ask again next round
                else:
                    continue
                logger.warning("%s server %r %s; it is killed and started again", pool.name,
                               server_id, reason)
                retired = await pool.retire(server_id, stalled)
                restart = Restart(pool, retired, server_id, reason, self._new_id(server_id))
                await call(pool.balancer, "expect", restart.next_id)
                await call(pool.balancer, "expect", server_id, False)  # the one report_dead set
                self._pending.append(restart)

    async def _start_again(self, restart: Restart) -> None:
        if self.restarts >= self.config.max_restarts:
            raise ServerRestartError(
                f"{restart.pool.name} server {restart.server_id!r} {restart.reason}; starting it "
                f"again would be restart {self.restarts + 1} of this run, past "
                f"rollout.fault_tolerance.max_restarts={self.config.max_restarts}: the run stops. "
                "Raise max_restarts, or find why servers fail (the server's Ray worker log)")
        self.restarts += 1
        restart.attempts += 1
        try:
            await restart.pool.start_again(restart.retired, restart.next_id)
        except Exception as error:
            restart.reason += (f"; restart attempt {restart.attempts} as {restart.next_id!r} "
                               f"failed: {type(error).__name__}: {error}")
            logger.warning("%s server %r %s", restart.pool.name, restart.server_id, restart.reason)
            failed, restart.next_id = restart.next_id, self._new_id(restart.server_id)
            await call(restart.pool.balancer, "expect", restart.next_id)
            await call(restart.pool.balancer, "expect", failed, False)
            return
        self._pending.remove(restart)
        logger.warning("%s server %r is back as %r (restart %d of at most %d)", restart.pool.name,
                       restart.server_id, restart.next_id, self.restarts,
                       self.config.max_restarts)

    def _new_id(self, server_id: str) -> str:
        """replica-1 -> replica-1-r1 -> replica-1-r2: a fresh id per start, so a client still
        holding the old handle can never report the new server dead."""
        base = re.sub(r"-r\d+$", "", server_id)
        self._starts[base] += 1
        return f"{base}-r{self._starts[base]}"

    async def _fail(self, error: ServerRestartError) -> None:
        logger.error("%s", error)
        self.failure = error
        self._failed.set()
        for pool in self.pools:  # clients waiting for a restart fail now instead
            try:
                await call(pool.balancer, "expect", None)
            except Exception:  # a balancer gone with its pool: nobody waits on it
                pass


async def _probe_all(servers: dict[str, Any], timeout_s: float) -> dict[str, tuple[str, bool]]:
    """server_id -> (what happened, stalled) for each server that failed its weight_version()
    probe: dead, or no answer within timeout_s."""
    async def probe(server: Any) -> tuple[str, bool] | None:
        try:
            await call(server, "weight_version", timeout_s=timeout_s)
        except DEAD_SERVER_ERRORS as error:
            return f"died ({type(error).__name__})", False
        except NoAnswerError:
            return f"stalled (no answer to weight_version() within {timeout_s:g} s)", True
        return None

    results = await asyncio.gather(*(probe(server) for server in servers.values()))
    return {sid: result for sid, result in zip(servers, results) if result is not None}
