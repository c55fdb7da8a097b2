"""separate_async spillover (beyond the seed; docs/trainer.md, "Spillover"): while the trainer
waits for data, the training workers' own (hybrid) engines join the balancer next to the
standalone replicas, and leave before the next update.

The fit loop joins right after a sync, before the bound admits the new version's groups: a
request sticks to its server, so only groups that start while the engines are in the balancer
run there. Leaving removes them with abort (the resumable client continues their requests on
the standalone servers) and puts them to sleep. These engines live inside the training workers
and must be loaded before they join, so they get the in-process seam (InProcessSync). They share
the elastic pool's registration and draining removal (ServerManager.add_replica / remove_replica),
not Fleet.add_replicas: there is no process to start or stop, and a training worker is never
restarted (docs/trainer.md, "An elastic pool").
"""

from __future__ import annotations

from typing import Any, TYPE_CHECKING

from tandem.serving.replica import RolloutReplica
from tandem.fleet.weight_sync import InProcessSync

if TYPE_CHECKING:
    from tandem.fleet.fleet import Fleet


class Spillover:
    """The training workers' engines as replicas that can join and leave `fleet.rollout`."""

    def __init__(self, fleet: "Fleet", below_groups: int) -> None:
        self.fleet = fleet
        self.below_groups = below_groups  # join when fewer finished groups than this wait
        self.replicas: list[RolloutReplica] = []
        self.weight_sync: InProcessSync | None = None
        self.joined = False
        self.joins = 0
        self._tokens_at_join = 0
        self.spilled_tokens = 0  # generated on the training devices, whole run

    async def start(self) -> None:
        """Start one engine per training worker (asleep until the first join)."""
        fleet = self.fleet
        for rank, worker in enumerate(fleet.workers):
            replica = RolloutReplica(rank, fleet.config.rollout, fleet.rollout.options)
            replica.server_id = f"spill-{rank}"  # beside the standalone replica-<rank>
            await replica.init_hybrid([worker])
            self.replicas.append(replica)
        self.weight_sync = InProcessSync(fleet.workers, [r.server_id for r in self.replicas],
                                         fleet.config.rollout.checkpoint_engine.timeout_s)
        await self._sleep()

    def should_join(self, depth: int, version: int, total_steps: int) -> bool:
        """Whether the trainer will train at `version` (< total_steps) and would wait for it,
        with fewer than below_groups finished groups."""
        return not self.joined and version < total_steps and depth < self.below_groups

    async def join(self, version: int) -> None:
        """Wake, load the actor's weights as `version`, and route requests here too."""
        await self._control("wake_up", ["weights"])
        await self.weight_sync.sync(version)
        await self._control("wake_up", ["kv_cache"])
        self._tokens_at_join = await self._tokens()
        for replica in self.replicas:
            await self.fleet.rollout.add_replica(replica)
        self.joined = True
        self.joins += 1

    async def leave(self) -> None:
        """Stop routing here; running requests move to the standalone servers; sleep."""
        if not self.joined:
            return
        for replica in self.replicas:
            await self.fleet.rollout.remove_replica(replica.server_id, abort=True)
        self.spilled_tokens += await self._tokens() - self._tokens_at_join
        self.joined = False
        await self._sleep()

    async def _control(self, verb: str, *args: Any) -> list[list[Any]]:
        answers = await self.fleet.rollout.control(verb, *args, replicas=self.replicas)
        return list(answers.results.values())

    async def _tokens(self) -> int:
        return sum(server["tokens"] for servers in await self._control("stats")
                   for server in servers)

    async def _sleep(self) -> None:
        if self.fleet.config.rollout.free_cache_engine:
            await self._control("sleep", ["kv_cache", "weights"])
