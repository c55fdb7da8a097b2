"""The server manager: replicas = devices // footprint, one global load balancer, clients, and
the one fan-out of verbs to servers: `control(verb, ...)` reaches every server of the fleet's
replicas (or of the replicas named), each call within its deadline; the trainer modes, the
weight-sync seam and spillover all go through it.

Servers that are Ray actors get a LoadBalancerActor; servers living in this process (the hybrid
in-process mode) get a plain LoadBalancer, so the whole path runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

import ray
from ray.util.placement_group import PlacementGroup

from tandem.config.choices import ConfigError
from tandem.config.footprint import replica_count, replica_world_size
from tandem.config.schema import RolloutConfig
from tandem.serving.balancer import BalancerStatus, LoadBalancer, LoadBalancerActor
from tandem.serving.client import DEAD_SERVER_ERRORS, ServerClient
from tandem.serving.remote import NoAnswerError, call, is_actor
from tandem.serving.replica import ControlTimeout, ReplicaLayout, RolloutReplica, ServerOptions
from tandem.serving.resumable_client import MAX_ABORTS_WITHOUT_PROGRESS, ResumableClient
from tandem.serving.server import CONTROL_VERBS

logger = logging.getLogger(__name__)


@dataclass
class Answers:
    """What one fanned-out verb returned: server_id -> the result of each of its servers (in
    order), and the replicas left out with their error."""

    results: dict[str, list[Any]]
    left_out: dict[str, BaseException] = field(default_factory=dict)


class ServerManager:
    """Owns the replicas and the balancer; fans trainer control calls out to every replica."""

    def __init__(self, config: RolloutConfig, options: ServerOptions, layout: ReplicaLayout,
                 balancer: Any) -> None:
        self.config = config
        self.options = options
        self.layout = layout
        self.balancer = balancer
        self.replicas: dict[str, RolloutReplica] = {}
        self.servers: dict[str, Any] = {}  # server_id -> main server; clients share this dict
        self.next_rank = 0  # of the next replica start_replicas() makes

    @classmethod
    async def create(cls, config: RolloutConfig, options: ServerOptions,
                     layout: ReplicaLayout | str, *, hosts: Sequence[Any] | None = None,
                     placement_group: PlacementGroup | None = None,
                     bundle_indices: Sequence[int] | None = None,
                     total_devices: int | None = None) -> "ServerManager":
        """Create every replica for `layout` and register it with a fresh balancer: HYBRID in
        `hosts` (the workers, local or Ray handles, one per device), COLOCATED on `bundle_indices`
        (default: all) of another role's `placement_group`, STANDALONE on `total_devices` (default:
        rollout.nnodes x rollout.n_gpus_per_node)."""
        layout = ReplicaLayout(layout)
        world_size = replica_world_size(config)
        if layout is ReplicaLayout.COLOCATED and placement_group is not None:
            bundle_indices = list(bundle_indices if bundle_indices is not None
                                  else range(placement_group.bundle_count))
        devices, remote = _device_pool(config, layout, hosts, placement_group, bundle_indices,
                                       total_devices)
        count = replica_count(devices, world_size)
        replicas = [RolloutReplica(rank, config, options) for rank in range(count)]
        if remote and not ray.is_initialized():
            raise RuntimeError(f"the {layout.value} layout starts Ray actors: call ray.init() "
                               "first")
        balancer = LoadBalancerActor.remote() if remote else LoadBalancer()
        manager = cls(config, options, layout, balancer)
        manager.next_rank = count
        if layout is ReplicaLayout.HYBRID:
            inits = [r.init_hybrid(hosts[r.replica_rank * world_size:][:world_size])
                     for r in replicas]
        elif layout is ReplicaLayout.COLOCATED:
            inits = [r.init_colocated(placement_group,
                                      bundle_indices[r.replica_rank * world_size:][:world_size])
                     for r in replicas]
        else:
            inits = [r.init_standalone() for r in replicas]
        results = await asyncio.gather(*inits, return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            # Do not leave half a fleet of actors and placement groups behind.
            await manager._stop(replicas)
            raise failures[0]
        for replica in replicas:
            await manager.add_replica(replica)
        return manager

    # -- clients ------------------------------------------------------------------------------

    def client(self, timeout_s: float | None = None) -> ServerClient:
        """A client for agent loops (picklable to other Ray processes when servers are actors)."""
        return ServerClient(self.balancer, self.servers, timeout_s)

    def resumable_client(self, resume: bool = True, timeout_s: float | None = None,
                         max_aborts_without_progress: int = MAX_ABORTS_WITHOUT_PROGRESS
                         ) -> ResumableClient:
        """A client that resumes aborted requests across weight updates."""
        return ResumableClient(self.client(timeout_s), resume, max_aborts_without_progress)

    # -- servers at run time (spillover, the elastic pool, restarts) ------------------------

    async def start_replicas(self, count: int) -> list[RolloutReplica]:
        """Start `count` more standalone replicas (placement groups of their own), not yet
        registered: the caller loads their weights, then add_replica(). A failed start stops
        the ones started and raises."""
        if self.layout is not ReplicaLayout.STANDALONE:
            raise RuntimeError(f"start_replicas: the {self.layout.value} layout places its servers "
                               "with another role's devices; only standalone replicas are added")
        replicas = [RolloutReplica(self.next_rank + i, self.config, self.options)
                    for i in range(count)]
        self.next_rank += count
        results = await asyncio.gather(*(r.init_standalone() for r in replicas),
                                       return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.stop_replicas(replicas)
            raise failures[0]
        return replicas

    async def add_replica(self, replica: RolloutReplica) -> None:
        """Open generation on an initialised replica (undoing a remove_replica(abort=True)) and
        route new requests to it too."""
        # A replica still rerouting would answer every call "aborted" with no token, forever.
        await self.control("resume_generation", replicas=[replica])
        # the handle inside an object reference: the balancer's process keeps it without
        # deserializing it, which would import the server's class (torch and the model code)
        handle = [ray.put(replica.main_server)] if replica.is_remote else None
        await call(self.balancer, "add_server", replica.server_id, handle)
        self.replicas[replica.server_id] = replica
        self.servers[replica.server_id] = replica.main_server

    async def remove_replica(self, server_id: str, abort: bool = False) -> RolloutReplica:
        """Stop routing to a replica and return it (it keeps running). With abort, its running
        requests, and calls that were already on their way to it, come back "aborted" at once,
        so resumable clients continue them on the other servers. resume_generation() on the
        replica undoes that before add_replica() registers it again."""
        if server_id not in self.replicas:
            raise KeyError(f"no replica {server_id!r}; replicas: {list(self.replicas)}")
        await call(self.balancer, "remove_server", server_id)
        # self.servers keeps the handle: a request routed there just before removal still gets it.
        replica = self.replicas.pop(server_id)
        if abort:
            await self.control("abort_all_requests", True, replicas=[replica])
            await self._drain(server_id)
        return replica

    async def _drain(self, server_id: str) -> None:
        """Wait (up to control_timeout_s) until every request routed to a removed server has come
        back: in reroute mode late ones come back "aborted" at once, so this takes a moment."""
        deadline = asyncio.get_running_loop().time() + self.options.control_timeout_s
        while await call(self.balancer, "in_flight_on", server_id):
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("replica %r: requests still routed there %s s after its removal",
                               server_id, self.options.control_timeout_s)
                return
            await asyncio.sleep(0.01)

    async def discard(self, server_id: str, stalled: bool = False) -> None:
        """A server found dead (or stalled) leaves the fleet and the balancer, counted in
        status().dead_servers (stalled_servers) unless a client reported it first."""
        self.replicas.pop(server_id, None)
        await call(self.balancer, "report_dead", server_id, 0, stalled)

    async def stop_replicas(self, replicas: list[RolloutReplica]) -> list[BaseException]:
        """Shut replicas down (their engines, then their processes and the groups they own);
        returns the errors other than dead servers. A server the balancer removed (dead or
        stalled) is not asked, and one that gives no answer is not an error: release() kills
        both."""
        try:
            status = await self.status()
            removed = {*status.dead_servers, *status.stalled_servers}
        except Exception:  # the balancer is gone too: ask every server
            removed = set()
        asked = [replica for replica in replicas if replica.server_id not in removed]
        answers = await self.control("shutdown", replicas=asked, on_error="leave_out")
        for replica in replicas:
            replica.release()
        for error in answers.left_out.values():
            if isinstance(error, ControlTimeout):
                logger.warning("%s; its process was killed", error)
        return [error for error in answers.left_out.values()
                if not isinstance(error, (*DEAD_SERVER_ERRORS, ControlTimeout))]

    async def status(self) -> BalancerStatus:
        """The balancer's view: in-flight and total requests per server."""
        return await call(self.balancer, "status")

    async def fault_metrics(self) -> dict[str, float]:
        """Counters for the trainer's metrics: servers found dead, requests retried elsewhere."""
        status = await self.status()
        return {"serving/dead_servers": float(len(status.dead_servers)),
                "serving/stalled_servers": float(len(status.stalled_servers)),
                "serving/retried_requests": float(status.retried_requests),
                "serving/servers": float(len(status.servers))}

    async def stats(self) -> dict[str, dict[str, Any]]:
        """server_id -> that replica's main-server counters."""
        return {sid: stats[0] for sid, stats in (await self.control("stats")).results.items()}

    async def weight_versions(self) -> dict[str, int | None]:
        """server_id -> the weight version its main server serves (None: it did not answer)."""
        answers = await self.control("weight_version", on_error="leave_out")
        return {sid: answers.results[sid][0] if sid in answers.results else None
                for sid in self.replicas}

    async def servers_behind(self, version: int) -> list[str]:
        """The servers not serving `version` (or not answering): a sync still owes them."""
        return sorted(sid for sid, served in (await self.weight_versions()).items()
                      if served != version)

    # -- the one fan-out ----------------------------------------------------------------------

    async def control(self, verb: str, *args: Any, replicas: Iterable[RolloutReplica] | None = None,
                      timeout_s: float | None = None,
                      on_error: Literal["raise", "leave_out"] = "raise") -> Answers:
        """`verb` (CONTROL_VERBS) on every server of `replicas` (default: the fleet's) at once, each
        call within timeout_s (default: options.control_timeout_s; past it a ControlTimeout).
        on_error="raise": a replica of the fleet whose actor died leaves it and is left out; any
        other error is raised, noting the server, once every call returned. "leave_out": every
        failed replica is left out with its error and the fleet stays as it is (docs/serving.md,
        "Control calls")."""
        if verb not in CONTROL_VERBS:
            raise ValueError(f"unknown control verb {verb!r}; one of {', '.join(CONTROL_VERBS)}")
        targets = list(self.replicas.values() if replicas is None else replicas)
        outcomes = await asyncio.gather(*(asyncio.gather(*(
            _on_server(replica, index, verb, args, timeout_s)
            for index in range(len(replica.servers)))) for replica in targets),
            return_exceptions=True)
        answers = Answers({})
        for replica, outcome in zip(targets, outcomes):
            if isinstance(outcome, BaseException):
                answers.left_out[replica.server_id] = outcome
            else:
                answers.results[replica.server_id] = list(outcome)
        if on_error == "leave_out":
            return answers
        dead = [sid for sid, error in answers.left_out.items()
                if isinstance(error, DEAD_SERVER_ERRORS) and sid in self.replicas]
        for server_id in dead:
            logger.warning("replica %r died (%s); it leaves the fleet", server_id,
                           type(answers.left_out[server_id]).__name__)
            self.replicas.pop(server_id, None)  # another call may have found it first
            await call(self.balancer, "report_dead", server_id, 0)
        for server_id, error in answers.left_out.items():
            if server_id not in dead:
                error.add_note(f"{verb}() on server {server_id!r}")
                raise error
        return answers

    async def shutdown(self) -> None:
        """Stop every replica and the balancer (a dead server's replica only drops its
        placement group); the first other error is raised afterwards."""
        replicas = list(self.replicas.values())
        self.replicas.clear()
        self.servers.clear()
        errors = await self._stop(replicas)
        if errors:
            raise errors[0]

    async def _stop(self, replicas: list[RolloutReplica]) -> list[BaseException]:
        """stop_replicas(), then kill the balancer; returns the errors other than dead servers."""
        errors = await self.stop_replicas(replicas)
        if is_actor(self.balancer):
            ray.kill(self.balancer)
        return errors


async def _on_server(replica: RolloutReplica, index: int, verb: str, args: tuple,
                     timeout_s: float | None) -> Any:
    """One server's call of a fan-out, within its deadline."""
    timeout_s = replica.options.control_timeout_s if timeout_s is None else timeout_s
    try:
        return await call(replica.servers[index], verb, *args, timeout_s=timeout_s)
    except NoAnswerError:
        where = replica.infos[index].address if index < len(replica.infos) else "not started"
        raise ControlTimeout(f"{verb}() on server {replica.server_id!r} ({where}) got no answer "
                             f"within {timeout_s} s") from None


def _device_pool(config: RolloutConfig, layout: ReplicaLayout, hosts: Sequence[Any] | None,
                 placement_group: PlacementGroup | None, bundle_indices: list[int] | None,
                 total_devices: int | None) -> tuple[int, bool]:
    """(devices the layout may use, whether its servers are Ray actors)."""
    if layout is ReplicaLayout.HYBRID:
        if not hosts:
            raise ValueError("the hybrid layout needs `hosts`: the workers (one per device) that "
                             "host the engines")
        kinds = {is_actor(host) for host in hosts}
        if len(kinds) != 1:
            raise ValueError("hybrid hosts must be all Ray actor handles or all local objects")
        return len(hosts), kinds.pop()
    if layout is ReplicaLayout.COLOCATED:
        if placement_group is None:
            raise ValueError("the colocated layout needs the `placement_group` it shares")
        return len(bundle_indices), True
    devices = config.nnodes * config.n_gpus_per_node if total_devices is None else total_devices
    if devices < 1:
        raise ConfigError("rollout.nnodes / rollout.n_gpus_per_node: the standalone layout runs on "
                          "devices of its own; set both to at least 1 (or pass total_devices)")
    return devices, True
