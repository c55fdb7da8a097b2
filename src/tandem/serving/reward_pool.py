"""The reward-model pool: one RewardModelServer actor per reserved device, each on a placement
group of its own (as standalone rollout replicas are), or sharing the training workers' bundles
(n_devices=0), registered with a load balancer of its own; hands out RewardModelClients. A server
found dead or stalled can be started again in its place (retire, start_again: the fleet's health
check, rollout.fault_tolerance)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from tandem.config.schema import RewardModelConfig
from tandem.serving.balancer import LoadBalancerActor
from tandem.serving.client import DEAD_SERVER_ERRORS, STALL_TIMEOUT_S
from tandem.serving.placement import device_bundle, in_bundle, reserve
from tandem.serving.remote import call
from tandem.serving.reward_client import RewardModelClient
from tandem.serving.reward_server import RewardModelServerActor, RewardServerInfo

logger = logging.getLogger(__name__)


class RewardModelPool:
    """The reward servers of a run, their placement groups and their balancer."""

    name = "reward_model"  # in the fleet's errors and metrics

    def __init__(self) -> None:
        self.balancer: Any = None
        self.servers: dict[str, Any] = {}  # the serving ones; clients share this dict
        self.infos: dict[str, RewardServerInfo] = {}
        self.lock = asyncio.Lock()  # the health check's: restarts are its only membership change
        self._groups: list[PlacementGroup] = []
        self._options: dict[str, dict] = {}  # server_id -> its actor options (its bundle)
        self._start: tuple = ()  # start()'s arguments, the same for every server
        self._start_timeout_s = 600.0

    @classmethod
    async def create(cls, model_path: str, config: RewardModelConfig, dtype: str = "float32",
                     device: str = "cpu", shared_group: PlacementGroup | None = None,
                     start_timeout_s: float = 600.0) -> "RewardModelPool":
        """Start config.n_devices servers (or one on bundle 0 of `shared_group` when n_devices is
        0) and register them; a failed start stops what was started."""
        pool = cls()
        pool.balancer = LoadBalancerActor.remote()
        pool._start = (model_path, dtype, device, config.torch_threads, config.max_batch_size,
                       config.max_length)
        pool._start_timeout_s = start_timeout_s
        try:
            placements = await pool._placements(config, device, shared_group, start_timeout_s)
            await asyncio.gather(*(pool._start_server(f"reward-{index}", options)
                                   for index, options in enumerate(placements)))
            for server_id, server in pool.servers.items():
                await pool._register(server_id, server)
        except BaseException:
            await pool.shutdown()
            raise
        return pool

    async def _start_server(self, server_id: str, options: dict) -> Any:
        """Start one server with `options` (its bundle) and load the model."""
        self._options[server_id] = options
        server = RewardModelServerActor.options(**options).remote(server_id)
        self.servers[server_id] = server
        self.infos[server_id] = await call(server, "start", *self._start,
                                           timeout_s=self._start_timeout_s)
        return server

    async def _register(self, server_id: str, server: Any) -> None:
        # the handle inside an object reference, as ServerManager.add_replica does
        await call(self.balancer, "add_server", server_id, [ray.put(server)])

    # -- restarts (the fleet's health check) -------------------------------------------------

    def probe_targets(self) -> dict[str, Any]:
        """server_id -> server of every member (the health check probes them)."""
        return dict(self.servers)

    def joining(self) -> set[str]:
        """Members not registered on purpose: none (a restarted server registers at once)."""
        return set()

    def changes(self) -> int:
        """Weight changes a probe could have been slowed by: none, the weights are fixed."""
        return 0

    async def retire(self, server_id: str, stalled: bool) -> str:
        """A server found dead or stalled leaves the balancer (counted) and is killed; returns
        what start_again() takes."""
        await call(self.balancer, "report_dead", server_id, 0, stalled)
        server = self.servers.pop(server_id)
        self.infos.pop(server_id, None)
        ray.kill(server, no_restart=True)
        return server_id

    async def start_again(self, retired: str, server_id: str) -> None:
        """Start `server_id` in the bundle of the retired server and register it."""
        options = self._options.pop(retired)
        try:
            await self._register(server_id, await self._start_server(server_id, options))
        except BaseException:  # the bundle stays the retired one's: a retry starts there
            server = self.servers.pop(server_id, None)
            if server is not None:
                ray.kill(server, no_restart=True)
            self._options.pop(server_id, None)
            self.infos.pop(server_id, None)
            self._options[retired] = options
            raise

    async def _placements(self, config: RewardModelConfig, device: str,
                          shared_group: PlacementGroup | None, timeout_s: float) -> list[dict]:
        if config.n_devices == 0:
            if shared_group is None:
                raise ValueError("reward.model.n_devices=0 shares the training workers' bundles: "
                                 "pass their placement group")
            # the training worker holds the whole bundle: the server shares its core unreserved
            return [in_bundle(shared_group, 0, {"CPU": 0.0})]
        bundle = device_bundle(device, config.torch_threads)  # CPU threads count on CPU
        placements = []
        for index in range(config.n_devices):
            group = await reserve([bundle], "STRICT_PACK", timeout_s,
                                  f"reward server {index} ({bundle}; reward.model.n_devices / "
                                  "reward.model.torch_threads)")
            self._groups.append(group)
            placements.append(in_bundle(group, 0, bundle))
        return placements

    def client(self, timeout_s: float | None = None,
               stall_timeout_s: float | None = STALL_TIMEOUT_S) -> RewardModelClient:
        """A client routing score calls over the pool's servers."""
        return RewardModelClient(self.balancer, self.servers, timeout_s, stall_timeout_s)

    async def stats(self) -> dict[str, dict[str, Any]]:
        """server_id -> its counters (servers that died are left out)."""
        results = await asyncio.gather(*(s.stats.remote() for s in self.servers.values()),
                                       return_exceptions=True)
        return {sid: r for sid, r in zip(self.servers, results) if not isinstance(r, BaseException)}

    async def shutdown(self) -> None:
        """Kill the servers and the balancer; free the placement groups."""
        for server in self.servers.values():
            try:
                ray.kill(server)
            except DEAD_SERVER_ERRORS:
                pass
        if self.balancer is not None:
            ray.kill(self.balancer)
        for group in self._groups:
            remove_placement_group(group)
        self.servers.clear()
        self._groups, self.balancer = [], None

