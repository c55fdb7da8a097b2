"""The reward-model pool: one RewardModelServer actor per reserved device, each on a placement
group of its own (as standalone rollout replicas are), or sharing the training workers' bundles
(n_devices=0), registered with a load balancer of its own; hands out RewardModelClients."""

from __future__ import annotations

import asyncio
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


class RewardModelPool:
    """The reward servers of a run, their placement groups and their balancer."""

    def __init__(self) -> None:
        self.balancer: Any = None
        self.servers: dict[str, Any] = {}
        self.infos: dict[str, RewardServerInfo] = {}
        self._groups: list[PlacementGroup] = []

    @classmethod
    async def create(cls, model_path: str, config: RewardModelConfig, dtype: str = "float32",
                     device: str = "cpu", shared_group: PlacementGroup | None = None,
                     start_timeout_s: float = 600.0) -> "RewardModelPool":
        """Start config.n_devices servers (or one on bundle 0 of `shared_group` when n_devices is
        0) and register them; a failed start stops what was started."""
        pool = cls()
        pool.balancer = LoadBalancerActor.remote()
        try:
            placements = await pool._placements(config, device, shared_group, start_timeout_s)
            for index, options in enumerate(placements):
                pool.servers[f"reward-{index}"] = RewardModelServerActor.options(**options).remote(
                    f"reward-{index}")
            infos = await asyncio.gather(*(
                call(server, "start", model_path, dtype, device, config.torch_threads,
                     config.max_batch_size, config.max_length, timeout_s=start_timeout_s)
                for server in pool.servers.values()))
            for server_id, info in zip(pool.servers, infos):
                pool.infos[server_id] = info
                await call(pool.balancer, "add_server", server_id)
        except BaseException:
            await pool.shutdown()
            raise
        return pool

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
        self.servers, self._groups, self.balancer = {}, [], None

