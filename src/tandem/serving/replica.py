"""A rollout replica: the server serving one model copy, placed by layout (seed §3.3, §5;
docs/serving.md, "Layouts"): HYBRID inside workers that already exist (no new process or devices),
COLOCATED as a new process on bundles of another role's placement group, STANDALONE as a new process
on one bundle of its own holding the whole footprint (TP devices), or, for a native replica wider
than a node, one bundle per node (STRICT_SPREAD) with a server on each: rank 0's on the first, which
is the replica's address, and a rank host (serving/rank_host.py) on each other. Verbs reach its
servers through ServerManager.control, and the other nodes' ranks through rank 0."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from tandem.config.footprint import replica_nodes, replica_world_size
from tandem.config.schema import RolloutConfig
from tandem.rollout.engine.rank_worker import Rendezvous
from tandem.rollout.registry import rollout_class
from tandem.serving.rank_host import RankHostActor, RankHostInfo
from tandem.serving.placement import device_bundle, in_bundle, reserve, wait_placed
from tandem.serving.remote import NoAnswerError, call, is_actor
from tandem.serving.server import RolloutServerActor, ServerInfo


class ReplicaLayout(str, Enum):
    """Where a replica's engine runs relative to the training workers."""

    HYBRID = "hybrid"
    COLOCATED = "colocated"
    STANDALONE = "standalone"


@dataclass
class ServerOptions:
    """What every server of a manager hosts, and how it is started and placed."""

    model_path: str  # an HF model directory
    dtype: str = "float32"
    device: str = "cpu"
    device_bundle: dict[str, float] | None = None  # Ray resources of one device (see bundle())
    torch_threads: int | None = None  # CPU threads per engine; default: the bundle's CPUs
    colocated_fraction: float = 0.1  # share of a colocated bundle's resources the server takes
    pause_timeout_s: float = 3600.0  # how long generate() waits while paused or asleep
    drain_timeout_s: float = 60.0  # how long abort_all_requests() waits for calls to return
    start_timeout_s: float = 600.0  # placement plus engine start
    control_timeout_s: float = 600.0  # every control verb (abort, sleep, wake, KV, weights)

    def bundle(self) -> dict[str, float]:
        """Resources of one device: one GPU (plus a CPU) on cuda, one CPU otherwise."""
        if self.device_bundle is not None:
            return dict(self.device_bundle)
        return device_bundle(self.device)

    def threads(self) -> int | None:
        """torch threads for a placed CPU server: the bundle's CPU count, at least 1."""
        if self.device.startswith("cuda"):
            return self.torch_threads
        return self.torch_threads or max(1, int(self.bundle().get("CPU", 1)))


class ControlTimeout(NoAnswerError):
    """A control verb got no answer from a server within its deadline; names verb and server."""


class RolloutReplica:
    """One model copy: world_size devices, one server, initialised by one of three layouts."""

    def __init__(self, replica_rank: int, config: RolloutConfig, options: ServerOptions) -> None:
        self.replica_rank = replica_rank
        self.config = config
        self.options = options
        self.world_size = replica_world_size(config)
        self.backend_class = rollout_class(config)
        self.server_id = f"replica-{replica_rank}"
        self.layout: ReplicaLayout | None = None
        self.servers: list[Any] = []
        self.infos: list[ServerInfo] = []
        self.rank_hosts: list[Any] = []  # the other nodes' servers of a replica spread over nodes
        self.rank_host_infos: list[RankHostInfo] = []
        self.placement_group: PlacementGroup | None = None
        self._owns_placement_group = False
        self._bundles: list[tuple[int, dict[str, float]]] = []  # (index, resources) per node

    # -- the three init paths ---------------------------------------------------------------

    async def init_hybrid(self, hosts: Sequence[Any]) -> None:
        """Start the engine inside existing workers: local RolloutServer objects (the driver
        process) or Ray handles of actors whose class subclasses RolloutServer."""
        if len(hosts) != self.world_size:
            raise ValueError(f"replica {self.replica_rank}: got {len(hosts)} hybrid worker(s) for "
                             f"a footprint of {self.world_size}")
        self._begin(ReplicaLayout.HYBRID)
        # The workers already own their devices and threads: nothing is placed or pinned.
        await self._start([hosts[0]], torch_threads=None)

    async def init_colocated(self, group: PlacementGroup, bundle_indices: Sequence[int]) -> None:
        """Start a new server process on bundles of a placement group another role also uses."""
        if len(bundle_indices) != self.world_size:
            raise ValueError(f"replica {self.replica_rank}: got {len(bundle_indices)} bundle(s) "
                             f"for a footprint of {self.world_size}")
        self._begin(ReplicaLayout.COLOCATED)
        self.placement_group = group
        share = self.options.colocated_fraction
        bundle = group.bundle_specs[bundle_indices[0]]
        resources = {k: round(v * share, 4) for k, v in bundle.items() if k in ("CPU", "GPU")}
        await wait_placed(group, self.options.start_timeout_s,
                          f"colocated replica {self.replica_rank}")
        await self._start_placed(group, [(bundle_indices[0], resources)])

    async def init_standalone(self) -> None:
        """Reserve world_size devices as a placement group of its own (one bundle, or one per
        node when the replica is wider than a node) and start the replica's servers on it."""
        self._begin(ReplicaLayout.STANDALONE)
        bundles = await self.init_standalone_group()
        await self._start_placed(self.placement_group, list(enumerate(bundles)))

    async def init_standalone_group(self) -> list[dict[str, float]]:
        """Reserve this replica's own placement group: one bundle of world_size devices, or one
        bundle per node on distinct nodes (STRICT_SPREAD) for a replica spread over nodes."""
        nodes = replica_nodes(self.config)
        bundles = [{name: amount * (self.world_size // nodes)
                    for name, amount in self.options.bundle().items()} for _ in range(nodes)]
        self.placement_group = await reserve(
            bundles, "STRICT_PACK" if nodes == 1 else "STRICT_SPREAD",
            self.options.start_timeout_s,
            f"standalone replica {self.server_id!r} ({nodes} x {bundles[0]}; rollout.nnodes / "
            "rollout.n_gpus_per_node)")
        self._owns_placement_group = True
        return bundles

    def _begin(self, layout: ReplicaLayout) -> None:
        if self.layout is not None:
            raise RuntimeError(f"replica {self.replica_rank} was already initialised as "
                               f"{self.layout.value}")
        self.layout = layout

    async def _start_placed(self, group: PlacementGroup,
                            bundles: list[tuple[int, dict[str, float]]]) -> None:
        """Start the replica's server on the first of `bundles` ((index, resources) of `group`)
        and, for a replica spread over nodes, a rank host on each other bundle, which starts
        its node's worker ranks towards rank 0's rendezvous."""
        options = self.options
        self._bundles = list(bundles)
        index, resources = bundles[0]
        main = RolloutServerActor.options(**in_bundle(group, index, resources)).remote(
            self.server_id, options.pause_timeout_s, options.drain_timeout_s)
        if len(bundles) == 1:
            await self._start([main], options.threads())
            return
        self.servers = [main]
        self.rank_hosts = [RankHostActor.options(**in_bundle(group, i, r)).remote(
            f"{self.server_id}-node{node}") for node, (i, r) in enumerate(bundles[1:], start=1)]
        per_node = self.world_size // len(bundles)
        rendezvous = await call(main, "rendezvous_point", per_node,
                                timeout_s=options.start_timeout_s)
        self.rank_host_infos = list(await asyncio.gather(*(
            call(host, "start", options.model_path, options.dtype, options.device, rendezvous,
                 range(node * per_node, (node + 1) * per_node), self.world_size,
                 options.threads(), timeout_s=options.start_timeout_s)
            for node, host in enumerate(self.rank_hosts, start=1))))
        await self._start([main], options.threads(), rendezvous)

    async def _start(self, servers: list[Any], torch_threads: int | None,
                     rendezvous: Rendezvous | None = None) -> None:
        options = self.options
        self.servers = servers
        try:
            self.infos = list(await asyncio.gather(*(
                call(server, "start", self.backend_class, options.model_path, self.config,
                     options.dtype, options.device, torch_threads,
                     *([] if rendezvous is None else [rendezvous]),
                     timeout_s=options.start_timeout_s) for server in servers)))
        except NoAnswerError:
            raise ControlTimeout(f"replica {self.replica_rank} ({self.server_id!r}): the "
                                 f"{self.config.name} engine did not start within "
                                 f"{options.start_timeout_s} s (trainer.timeout_s)") from None

    # -- a restart --------------------------------------------------------------------------

    def kill(self) -> None:
        """Kill the server processes now (a dead or stalled server: no shutdown call), keeping
        the placement group, whose bundle start_again() starts the next server in."""
        if self.layout is ReplicaLayout.HYBRID:
            raise RuntimeError(f"replica {self.server_id!r} lives in a training worker, which is "
                               "never killed or restarted")
        for server in self.servers + self.rank_hosts:
            ray.kill(server, no_restart=True)

    async def start_again(self, server_id: str) -> RolloutReplica:
        """A replica like this killed one, named `server_id`, started in the same bundle (or, if
        its own placement group is gone, in a new one); it takes over the placement group, which
        comes back to this replica on an error (so start_again can be tried again)."""
        if self.layout is None or self.layout is ReplicaLayout.HYBRID or not self._bundles:
            raise RuntimeError(f"replica {self.server_id!r} ({self.layout}) cannot be started "
                               "again: only placed standalone or colocated servers can")
        again = RolloutReplica(self.replica_rank, self.config, self.options)
        again.server_id = server_id
        again._begin(self.layout)
        group, owned = self.placement_group, self._owns_placement_group
        self.placement_group, self._owns_placement_group = None, False
        self.servers, self.rank_hosts = [], []
        try:
            if owned and not _placed(group):  # its node went away: Ray removed or re-places it
                if group is not None:
                    remove_placement_group(group)
                await again.init_standalone_group()
            else:
                again.placement_group, again._owns_placement_group = group, owned
                await wait_placed(group, self.options.start_timeout_s,
                                  f"replica {server_id!r} (a restart of {self.server_id!r})")
            await again._start_placed(again.placement_group, self._bundles)
        except BaseException:  # the placement goes back to this replica: a retry starts there
            for server in again.servers + again.rank_hosts:
                ray.kill(server, no_restart=True)
            self.placement_group = again.placement_group
            self._owns_placement_group = again._owns_placement_group
            raise
        return again

    # -- what the manager and balancer see --------------------------------------------------

    @property
    def main_server(self) -> Any:
        """The server requests go to (node-rank 0)."""
        if not self.servers:
            raise RuntimeError(f"replica {self.replica_rank} is not initialised")
        return self.servers[0]

    @property
    def is_remote(self) -> bool:
        """True when the servers are Ray actors, False when they live in this process."""
        return is_actor(self.main_server)

    def release(self) -> None:
        """Kill the server processes and free the placement group this replica created (the
        manager tells the engines to shut down first); hybrid hosts are left running."""
        if self.layout is not ReplicaLayout.HYBRID:
            for server in self.servers + self.rank_hosts:
                ray.kill(server)
        if self._owns_placement_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.servers, self.rank_hosts = [], []


def _placed(group: PlacementGroup | None) -> bool:
    """Whether a placement group still exists (not removed)."""
    return group is not None and (
        ray.util.placement_group_table(group).get("state") not in ("REMOVED", None))
