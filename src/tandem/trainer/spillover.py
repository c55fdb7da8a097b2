"""separate_async spillover (beyond the seed): while the trainer waits for data, the training
workers' own (hybrid) engines join the balancer next to the standalone replicas, and leave
before the next update.

join: sync the actor's weights into each worker's engine in-process (naive, version = step) ->
add it to the balancer. leave: remove it from the balancer with abort (its running requests
come back "aborted" and the resumable client continues them on the standalone servers) ->
sleep it (free its memory for training). The actor's weights must be the served version, so the
fit loop spills only before the first mini-batch update after a sync.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tandem.serving.replica import RolloutReplica

if TYPE_CHECKING:
    from tandem.trainer.rl_trainer import RLTrainer


class Spillover:
    """The training workers' engines as replicas that can join and leave `trainer.manager`."""

    def __init__(self, trainer: "RLTrainer", below_groups: int) -> None:
        self.trainer = trainer
        self.below_groups = below_groups  # join when fewer finished groups than this wait
        self.replicas: list[RolloutReplica] = []
        self.joined = False
        self.joins = 0
        self._tokens_at_join = 0
        self.spilled_tokens = 0  # generated on the training devices, whole run

    async def start(self) -> None:
        """Start one engine per training worker (asleep until the first join)."""
        trainer = self.trainer
        for rank, worker in enumerate(trainer.workers):
            replica = RolloutReplica(rank, trainer.config.rollout, trainer.manager.options)
            replica.server_id = f"spill-{rank}"  # beside the standalone replica-<rank>
            await replica.init_hybrid([worker])
            self.replicas.append(replica)
        await self._sleep()

    def should_join(self, depth: int) -> bool:
        """Whether the trainer is about to wait with fewer than below_groups finished groups."""
        return not self.joined and depth < self.below_groups

    async def join(self) -> None:
        """Load the actor's weights (version = trainer.step) and route requests here too."""
        trainer = self.trainer
        await asyncio.gather(*(w.sync_weights.remote(trainer.step) for w in trainer.workers))
        self._tokens_at_join = await self._tokens()
        for replica in self.replicas:
            await trainer.manager.add_replica(replica)
        self.joined = True
        self.joins += 1

    async def leave(self) -> None:
        """Stop routing here; running requests move to the standalone servers; sleep."""
        if not self.joined:
            return
        for replica in self.replicas:
            await self.trainer.manager.remove_replica(replica.server_id, abort=True)
        self.spilled_tokens += await self._tokens() - self._tokens_at_join
        self.joined = False
        await self._sleep()

    async def _tokens(self) -> int:
        stats = await asyncio.gather(*(replica.stats() for replica in self.replicas))
        return sum(server["tokens"] for servers in stats for server in servers)

    async def _sleep(self) -> None:
        if self.trainer.config.rollout.free_cache_engine:
            await asyncio.gather(*(replica.sleep(["kv_cache", "weights"]) for replica in self.replicas))
