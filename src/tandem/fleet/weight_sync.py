"""The fleet's one weight-sync seam: the actor's weights -> every rollout engine of a layout, as
`await sync(version) -> SyncReport`, with two implementations chosen once by layout:

- HYBRID: `InProcessSync`: every training worker loads its actor's weights into the engine in
  its own process (the `naive` checkpoint engine, no copy), all at once, each within the
  deadline; waking the engine's memory first is the mode's business.
- COLOCATED / STANDALONE: `CrossProcessSync` through a checkpoint engine, in the seed's order
  (§10.3, `CrossProcessSync.sync`): encode ahead (delta, while generation goes on), abort,
  release the KV cache, build topology, send || receive + load, resume KV cache and generation.
  With shm into engines that serve from two weight slots nothing is aborted: the actor writes
  each inactive slot and the engine flips. A server dead or stuck before the transfer is left
  out (`SyncReport.left_out`); a failure during it raises WeightSyncError naming the phase and
  the peer; either way every server resumes on its last complete version. Every wait has the
  deadline rollout.checkpoint_engine.timeout_s.

`choose_transport` resolves rollout.checkpoint_engine.backend=auto once the fleet knows where
every server runs: shm when all share the sender's host, else nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Protocol, Sequence

from ray.exceptions import RayActorError, RayTaskError

from tandem.config.choices import ConfigError
from tandem.serving.manager import Answers, ServerManager
from tandem.serving.remote import NoAnswerError, call, resolve, submit
from tandem.serving.replica import ReplicaLayout, RolloutReplica
from tandem.weight_sync.base import WeightSyncError


@dataclass
class SyncReport:
    """What one sync did: seconds per phase (metric names), the version each server serves
    now (None: it did not answer), and the servers left out with the reason."""

    version: int
    timings: dict[str, float]
    served: dict[str, int | None]
    left_out: dict[str, str] = field(default_factory=dict)

    def behind(self) -> list[str]:
        """Servers not serving this sync's version."""
        return sorted(sid for sid, version in self.served.items() if version != self.version)

    def metrics(self) -> dict[str, float]:
        """The step's sync metrics: every phase's seconds, the whole sync as time/sync_inner,
        and how many servers it left behind."""
        return {**self.timings, "time/sync_inner": self.timings["sync/total_s"],
                "sync/servers_behind": float(len(self.behind()))}


class WeightSync(Protocol):
    """Moves the actor's weights into every engine of one layout, all or nothing per engine."""

    async def sync(self, version: int) -> SyncReport:
        """Load the actor's current weights everywhere as `version`; WeightSyncError on failure."""


def choose_transport(backend: str, device: str, sender_node: str | None,
                     server_nodes: dict[str, str | None], engine_kwargs: dict) -> str:
    """The checkpoint engine of a cross-process sync: `backend` as configured, "auto" resolved
    (shm when every server runs on the sender's node, else nccl on CUDA / gloo on CPU). A shm
    transport (shm, or delta over shm) with a server on another host is a ConfigError."""
    remote = sorted(sid for sid, node in server_nodes.items() if node != sender_node)
    if backend == "naive":
        raise ConfigError("rollout.checkpoint_engine.backend: 'naive' hands tensors over inside "
                          "one process, but these servers run in their own; set it to auto")
    if backend == "auto":
        return ("nccl" if device.startswith("cuda") else "gloo") if remote else "shm"
    over_shm = backend == "shm" or (backend == "delta"
                                    and engine_kwargs.get("transport", "shm") == "shm")
    if over_shm and remote:
        field_name = ("rollout.checkpoint_engine.engine_kwargs.transport" if backend == "delta"
                      else "rollout.checkpoint_engine.backend")
        raise ConfigError(f"{field_name}: shared memory reaches only the sender's host, but "
                          f"servers {', '.join(remote)} run on other hosts; use gloo (CPU) or "
                          "nccl (CUDA), or backend=auto")
    return backend


def receiver_nodes(replicas: Sequence) -> dict[str, str | None]:
    """server_id -> the Ray node of its main server (from the replicas' ServerInfo)."""
    return {replica.server_id: replica.infos[0].node_id for replica in replicas}


class InProcessSync:
    """Syncs `workers` (HybridWorker handles or local objects, rank order); server ids name
    the engines in the report."""

    def __init__(self, workers: Sequence[Any], server_ids: Sequence[str], timeout_s: float) -> None:
        if len(workers) != len(server_ids):
            raise ValueError(f"{len(workers)} workers for {len(server_ids)} server ids")
        self.workers, self.server_ids = list(workers), list(server_ids)
        self.timeout_s = timeout_s

    async def sync(self, version: int) -> SyncReport:
        """Every worker's load_actor_weights(version) at once; WeightSyncError("load", worker)
        when one gives no answer within timeout_s (rollout.checkpoint_engine.timeout_s)."""
        start = time.perf_counter()
        await asyncio.gather(*(self._load(rank, worker, version)
                               for rank, worker in enumerate(self.workers)))
        seconds = time.perf_counter() - start
        return SyncReport(version, {"sync/load_s": seconds, "sync/total_s": seconds},
                          {sid: version for sid in self.server_ids})

    async def _load(self, rank: int, worker: Any, version: int) -> None:
        try:
            await call(worker, "load_actor_weights", version, timeout_s=self.timeout_s)
        except NoAnswerError:
            raise WeightSyncError("load", f"hybrid worker {rank} ({self.server_ids[rank]})",
                                  f"no answer within {self.timeout_s} s "
                                  "(rollout.checkpoint_engine.timeout_s)") from None


class CrossProcessSync:
    """Drives syncs from `trainers` (training workers, rank 0 first: Ray handles or local
    objects with encode_weights_ahead / build_sync_plan / send_weights) into every replica of
    `servers` through the checkpoint engine `engine` (never naive), every wait within timeout_s.
    With `frozen` (actor.freeze_vision_tower) a sync that is not double-buffered asks the
    servers whether they hold every weight, and the actor's frozen weights stay behind if so."""

    def __init__(self, trainers: Sequence[Any], servers: ServerManager, engine: str,
                 timeout_s: float, engine_kwargs: dict[str, Any] | None = None,
                 frozen: bool = False) -> None:
        if servers.layout is ReplicaLayout.HYBRID:
            raise ValueError("the hybrid layout syncs inside each worker (InProcessSync); the "
                             "cross-process sync is for standalone and colocated replicas")
        if not trainers:
            raise ValueError("no training workers to send weights from")
        if engine == "naive":
            raise ValueError("the cross-process sync needs a transport between processes, not "
                             "'naive' (rollout.checkpoint_engine.backend)")
        self.trainers = list(trainers)
        self.servers = servers
        self.engine = engine
        self.timeout_s = timeout_s
        self.engine_kwargs = dict(engine_kwargs or {})  # receivers build the same engine
        self.frozen = frozen

    async def sync(self, version: int, replicas: Sequence[RolloutReplica] | None = None
                   ) -> SyncReport:
        """One sync of the actor's weights as `version` into `replicas` (default: every replica
        of the fleet; a restarted or added one joins this way before it is registered); raises
        WeightSyncError on failure (after resuming generation everywhere it paused it)."""
        timings: dict[str, float] = {}
        left_out: dict[str, str] = {}
        start = time.perf_counter()
        targets = list(self.servers.replicas.values() if replicas is None else replicas)
        await self._encode_ahead(version, timings)
        paused_at = time.perf_counter()
        slots, replicas = await self._offered_slots(targets, timings, left_out)
        if slots is not None:  # double-buffered: generation goes on; each engine flips
            await self._transfer(replicas, version, timings, slots)
            timings["sync/pause_s"] = timings.get("sync/flip_s", 0.0)
            return await self._report(version, targets, timings, start, left_out)
        paused = _answered(replicas, await self._each(replicas, "abort", timings, left_out,
                                                      "abort_all_requests"))
        try:
            released = _answered(paused, await self._each(paused, "release_kv_cache", timings,
                                                           left_out, "release_kv_cache"))
            if not released:
                raise WeightSyncError("prepare", None, "no rollout server is left to receive "
                                      f"version {version}: {left_out}")
            await self._transfer(released, version, timings, None)
        finally:
            # generation resumes whatever happened above, on each server's last complete version
            await self._each(paused, "resume_kv_cache", timings, left_out, "resume_kv_cache")
            await self._each(paused, "resume_generation", timings, left_out, "resume_generation")
        # abort .. resume: nothing generates (encoding ahead came before)
        timings["sync/pause_s"] = time.perf_counter() - paused_at
        return await self._report(version, targets, timings, start, left_out)

    async def _encode_ahead(self, version: int, timings: dict[str, float]) -> None:
        """Every training rank's encode_weights_ahead (rank 0's sender prepares `version`; a
        no-op for engines that do not encode ahead), within the deadline."""
        begin = time.perf_counter()
        await asyncio.gather(*(self._within(
            call(trainer, "encode_weights_ahead", self.engine, version, timeout_s=self.timeout_s),
            "prepare", f"sender rank {rank}") for rank, trainer in enumerate(self.trainers)))
        timings["sync/encode_s"] = time.perf_counter() - begin

    async def _report(self, version: int, targets: list[RolloutReplica],
                      timings: dict[str, float], start: float,
                      left_out: dict[str, str]) -> SyncReport:
        timings["sync/total_s"] = time.perf_counter() - start
        timings["sync/copy_s"] = timings.get("sync/send_s", 0.0)  # the sender's pass over the weights
        answers = await self.servers.control("weight_version", replicas=targets,
                                             timeout_s=self.timeout_s, on_error="leave_out")
        served = {r.server_id: answers.results[r.server_id][0]
                  if r.server_id in answers.results else None for r in targets}
        return SyncReport(version, timings, served, left_out)

    async def _offered_slots(self, replicas: list[RolloutReplica], timings: dict[str, float],
                             left_out: dict[str, str]) -> tuple[list | None, list[RolloutReplica]]:
        """Every receiving server's weight slots when this sync can be double-buffered (shm,
        engine_kwargs.double_buffer not false, every engine serving from slots), else None; and
        the replicas that answered (one that fails the offer goes to left_out, as on the ring)."""
        if self.engine != "shm" or self.engine_kwargs.get("double_buffer") is False:
            return None, replicas
        answers = await self._each(replicas, "prepare_slots", timings, left_out,
                                   "weight_slots", self.engine_kwargs)
        for server_id, error in answers.left_out.items():
            if isinstance(error, ValueError):  # double_buffer true and the slots do not fit
                raise WeightSyncError("prepare", server_id, str(error)) from error
        if not answers.results:
            raise WeightSyncError("prepare", None, f"no rollout server is left to receive: {left_out}")
        offered = [slots for results in answers.results.values() for slots in results]
        return ((offered if all(slots is not None for slots in offered) else None),
                _answered(replicas, answers))

    async def _each(self, replicas: list[RolloutReplica], phase: str, timings: dict[str, float],
                    left_out: dict[str, str], verb: str, *args: Any) -> Answers:
        """`verb` on every server of `replicas` through the fleet's fan-out, each within the
        deadline; the replicas that failed go to left_out, named with the phase."""
        begin = time.perf_counter()
        answers = await self.servers.control(verb, *args, replicas=replicas,
                                             timeout_s=self.timeout_s, on_error="leave_out")
        timings[f"sync/{phase}_s"] = time.perf_counter() - begin
        for server_id, error in answers.left_out.items():
            left_out[server_id] = f"{phase}: {type(error).__name__}: {error}"
        return answers

    async def _transfer(self, replicas: list[RolloutReplica], version: int,
                        timings: dict[str, float], slots: list | None) -> None:
        """build topology, then send || receive + load (each participant finalizes itself)."""
        receivers = _receivers(replicas)
        begin = time.perf_counter()
        answers = await self.servers.control("weight_version", replicas=replicas,
                                             timeout_s=self.timeout_s, on_error="leave_out")
        for server_id, error in answers.left_out.items():
            peer = next(name for name, _ in receivers if name.endswith(f"({server_id})"))
            raise WeightSyncError("build_topology", peer,
                                  f"{type(error).__name__}: {error}") from error
        versions = [version for replica in replicas
                    for version in answers.results[replica.server_id]]
        # slots hold whole versions: a double-buffered sync sends everything
        extra = (slots,) if slots is not None else (None, await self._hold_all(replicas))
        plan = await self._within(call(self.trainers[0], "build_sync_plan", self.engine,
                                       len(receivers), version, versions, *extra,
                                       timeout_s=self.timeout_s),
                                  "build_topology", "sender rank 0")
        timings["sync/build_topology_s"] = time.perf_counter() - begin
        begin = time.perf_counter()
        peers = [(f"sender rank {rank}", submit(trainer, "send_weights", plan))
                 for rank, trainer in enumerate(self.trainers)]
        peers += [(name, submit(server, "receive_weights", plan, rank, self.engine_kwargs))
                  for rank, (name, server) in enumerate(receivers, start=1)]
        tasks = {asyncio.ensure_future(resolve(pending, None, name)): name
                 for name, pending in peers}
        await self._wait_all(tasks)
        timings["sync/transfer_s"] = time.perf_counter() - begin
        failures = []
        for task, name in tasks.items():
            error = asyncio.CancelledError() if task.cancelled() else task.exception()
            if error is None:
                for key, value in task.result().items():
                    if key != "version":  # the slowest participant sets each phase's time
                        metric = "sync/bytes_moved" if key == "bytes_moved" else f"sync/{key}_s"
                        timings[metric] = max(timings.get(metric, 0.0), value)
            else:
                failures.append((name, error))
        if failures:
            labels = {name.split(" (")[0]: name for name, _ in receivers}
            raise _transfer_error(failures, labels, self.timeout_s)

    async def _hold_all(self, replicas: list[RolloutReplica]) -> bool:
        """Whether the frozen weights may stay behind: the actor has some and every server of
        `replicas` holds all its weights (none dropped by sleep)."""
        if not self.frozen:
            return False
        answers = await self.servers.control("synced_in_full", replicas=replicas,
                                             timeout_s=self.timeout_s, on_error="leave_out")
        return not answers.left_out and all(held for results in answers.results.values()
                                            for held in results)

    async def _wait_all(self, tasks: dict[asyncio.Task, str]) -> None:
        """Wait for every participant. Each bounds its own waits by timeout_s and reports its
        own error; the manager gives up on the rest (cancelling them) only when none has
        finished for 2 x timeout_s, so a participant that never answers cannot hang the sync."""
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=2 * self.timeout_s,
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)
                return

    async def _within(self, awaitable: Awaitable, phase: str, peer: str) -> Any:
        """Await a call that has its own deadline; any failure becomes a WeightSyncError."""
        try:
            return await awaitable
        except Exception as error:
            raise WeightSyncError(phase, peer, f"{type(error).__name__}: {error}") from error


def _answered(replicas: list[RolloutReplica], answers: Answers) -> list[RolloutReplica]:
    """The replicas that answered a fanned-out verb."""
    return [replica for replica in replicas if replica.server_id in answers.results]


def _receivers(replicas: list[RolloutReplica]) -> list[tuple[str, Any]]:
    """(name, server) of every receiving server, rank 1 first."""
    return [(f"receiver {rank} ({replica.server_id})", server) for rank, (replica, server)
            in enumerate(((r, s) for r in replicas for s in r.servers), start=1)]


def _transfer_error(failures: list[tuple[str, BaseException]], labels: dict[str, str],
                    timeout_s: float) -> WeightSyncError:
    """One error for a failed transfer: the phase of the first WeightSyncError a participant
    raised (else of the first failure), the peer that died (else the one that error names),
    and every participant's error listed."""
    failures = [(name, error.cause if isinstance(error, RayTaskError) else
                 TimeoutError(f"no answer within {2 * timeout_s} s")
                 if isinstance(error, asyncio.CancelledError) else error)
                for name, error in failures]
    named = [(name, error) for name, error in failures if isinstance(error, WeightSyncError)]
    dead = [name for name, error in failures if isinstance(error, RayActorError)]
    name, first = (named or failures)[0]
    if isinstance(first, WeightSyncError):
        phase, peer = first.phase, labels.get(first.peer, first.peer) or name
    else:  # the participant died or gave no answer in time
        phase, peer = ("send" if name.startswith("sender") else "receive"), name
    peer = dead[0] if dead else peer  # a dead process is the peer at fault, whoever noticed
    listing = "; ".join(f"{who}: {type(error).__name__}: {error}" for who, error in failures)
    return WeightSyncError(phase, peer, f"{len(failures)} participant(s) failed (deadline "
                                        f"{timeout_s} s per wait): {listing}")
