"""The rollout fleet of one run: Ray, placement, the training workers, the rollout servers, the
client each mode uses and the one weight-sync seam, behind the calls a mode's phase order names. The
layout is chosen once from the config (config/footprint.py): HYBRID, the engines inside the training
workers, or STANDALONE replicas when the rollout has devices of its own; the mode only decides the
order of the calls. Standalone replicas form a pool that can grow and shrink between steps
(fleet/rollout_pool.py); with rollout.fault_tolerance a health check restarts the servers of their
own that die or stall (fleet/health.py). A training worker is never restarted."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Awaitable, Iterable, Sequence, TypeVar

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from tandem.config.footprint import replica_count, replica_world_size, rollout_devices
from tandem.config.schema import TandemConfig
from tandem.config.pool_check import HYBRID_IS_FATAL
from tandem.serving.client import DEAD_SERVER_ERRORS
from tandem.serving.manager import Answers, ServerManager
from tandem.serving.placement import in_bundle
from tandem.serving.remote import NoAnswerError, call
from tandem.serving.replica import ReplicaLayout, ServerOptions
from tandem.serving.resumable_client import ResumableClient
from tandem.fleet import placement
from tandem.fleet.health import FleetHealth
from tandem.fleet.hybrid_worker import HybridWorkerActor
from tandem.fleet.rollout_pool import RolloutPool, pressure_size, scheduled_size
from tandem.fleet.served_rewards import ServedRewards
from tandem.fleet.startup import StartupClock
from tandem.fleet.weight_sync import (CrossProcessSync, InProcessSync, WeightSync,
                                      choose_transport, receiver_nodes)

logger = logging.getLogger(__name__)
T = TypeVar("T")
# worker calls that change the actor's weights: a replica started after one waits for the next sync
ACTOR_WRITES = ("update_actor", "update_actor_on_policy", "load_checkpoint")


class TrainingWorkerLost(RuntimeError):
    """A training worker's process died: the run stops (workers are never restarted)."""


class Fleet:
    """Owns every process of a run and what moves between them; `rollout` is the server manager
    the client and the control verbs go through."""

    def __init__(self, config: TandemConfig, model_path: Path, startup: StartupClock) -> None:
        self.config = config
        self.model_path = model_path
        self.startup = startup
        self.layout = (ReplicaLayout.STANDALONE if rollout_devices(config)
                       else ReplicaLayout.HYBRID)
        self.workers: list[Any] = []
        self.worker_addresses: list[str] = []  # where each rank runs, for error messages
        self.placement_group: PlacementGroup | None = None
        self.rollout: ServerManager | None = None
        self.pool: RolloutPool | None = None  # the standalone replicas (None: hybrid)
        self.health: FleetHealth | None = None  # rollout.fault_tolerance.enable
        self.weight_sync: WeightSync | None = None
        self.transport = "naive"  # the checkpoint engine the sync uses (resolved at start)
        self.rewards = ServedRewards(config)  # reward.model / reward.judge servers

    async def start(self, actor_steps: int, critic_steps: int) -> None:
        """Join or start Ray, place one training worker per device bundle (rendezvous on rank
        0's node), start the rollout servers of the layout, the weight-sync seam and the served
        rewards (reward pools of their own, or the workers' bundles: reward.*.n_devices)."""
        config, timeout_s = self.config, self.config.trainer.timeout_s
        n = config.trainer.n_devices
        placement.init_ray(config)
        self.startup.mark("ray")
        self.placement_group = await placement.reserve_devices(config)
        worker_threads, server_threads = placement.torch_threads(config)
        init_method = await placement.rank0_rendezvous(self.placement_group) if n > 1 else None
        bundle = placement.device_bundle(config)
        self.workers = [HybridWorkerActor.options(
            **in_bundle(self.placement_group, rank, bundle)).remote(
            config, rank, n, init_method, actor_steps, critic_steps, worker_threads)
            for rank in range(n)]
        try:  # the actors load the model and join the training group in their constructor
            self.worker_addresses = list(await asyncio.gather(*(
                call(worker, "ping", timeout_s=timeout_s) for worker in self.workers)))
        except NoAnswerError:
            raise NoAnswerError(f"training workers did not start within {timeout_s} s "
                                "(trainer.timeout_s)") from None
        self.startup.mark("workers")
        options = ServerOptions(model_path=str(self.model_path), dtype=config.model.dtype,
                                device=config.model.device, torch_threads=server_threads,
                                start_timeout_s=timeout_s, control_timeout_s=timeout_s)
        ckpt = config.rollout.checkpoint_engine
        if self.layout is ReplicaLayout.STANDALONE:  # on CPU a device is one core
            auto = config.rollout.elastic.auto  # sized by pressure: start at its minimum
            first = (auto.min_replicas * replica_world_size(config.rollout) if auto.enable
                     else None)
            self.rollout = await ServerManager.create(config.rollout, options, "standalone",
                                                      total_devices=first)
            sender_node = await call(self.workers[0], "node_id", timeout_s=timeout_s)
            self.transport = choose_transport(ckpt.backend, config.model.device, sender_node,
                                              receiver_nodes(self.rollout.replicas.values()),
                                              ckpt.engine_kwargs)
            engine_kwargs = dict(ckpt.engine_kwargs)
            # a LoRA sync streams only the adapter, while weight slots hold full versions
            if config.actor.lora.rank and self.transport == "shm":
                engine_kwargs["double_buffer"] = False
            self.weight_sync = CrossProcessSync(self.workers, self.rollout, self.transport,
                                                ckpt.timeout_s, engine_kwargs,
                                                frozen=config.actor.freeze_vision_tower
                                                and not config.actor.lora.rank)
            self.pool = RolloutPool("rollout", self.rollout, self.weight_sync)
        else:
            self.rollout = await ServerManager.create(config.rollout, options, "hybrid",
                                                      hosts=self.workers)
            self.weight_sync = InProcessSync(self.workers, list(self.rollout.replicas),
                                             ckpt.timeout_s)
        placement.log_torch_threads(config, await self.on_workers("torch_threads"), self.rollout)
        await self.rewards.start(self.placement_group)
        if config.rollout.fault_tolerance.enable:
            if self.pool is not None:
                self.pool.restarts = True
            pools = ([self.pool] if self.pool else []) + self.rewards.pools()
            self.health = FleetHealth(config.rollout.fault_tolerance, pools)
            await self.health.start()
        self.startup.mark("servers")

    def client(self) -> Any:
        """The client agent loops use: plain in sync mode; in the async modes the resumable one,
        which finishes requests aborted by a weight sync with the new weights."""
        if self.config.trainer.trainer_mode == "sync":
            return self.rollout.client()
        return ResumableClient(self.rollout.client())

    async def on_workers(self, method: str, args_per_rank: Sequence[tuple] | None = None
                         ) -> list[Any]:
        """`method` on every training worker at once (rank r gets args_per_rank[r], default no
        arguments), each within trainer.worker_timeout_s: a stalled worker stops the run with a
        NoAnswerError naming the method (the phase) and the worker, never hangs it."""
        timeout_s = self.config.trainer.worker_timeout_s
        args_per_rank = args_per_rank or [()] * len(self.workers)

        async def one(rank: int, args: tuple) -> Any:
            where = (self.worker_addresses[rank] if rank < len(self.worker_addresses)
                     else "address unknown")
            try:
                return await call(self.workers[rank], method, *args, timeout_s=timeout_s)
            except NoAnswerError:
                raise NoAnswerError(f"{method}: training worker {rank} ({where}) gave no answer "
                                    f"within {timeout_s} s (trainer.worker_timeout_s): stalled, "
                                    "or a step longer than that; the run stops") from None
            except DEAD_SERVER_ERRORS as error:
                raise TrainingWorkerLost(
                    f"{method}: training worker {rank} ({where}) died ({type(error).__name__}). "
                    "A training worker holds the actor's state (and in the hybrid layout a rollout "
                    "engine) and is never restarted: rollout.fault_tolerance restarts standalone "
                    "rollout servers and served-reward servers only. The run stops; resume it from "
                    "its last checkpoint (trainer.resume=true)") from error

        if self.pool is not None and method in ACTOR_WRITES:
            await self.pool.actor_changes()  # a replica started from now on waits for the sync
        return list(await asyncio.gather(*(one(rank, args)
                                           for rank, args in enumerate(args_per_rank))))

    # ---- the calls a mode's phase order is made of ------------------------------------------

    async def abort(self) -> int:
        """Pause generation on every server and abort what runs (the resumable client keeps the
        tokens); returns how many requests were running."""
        answers = await self._control("abort_all_requests")
        return sum(sum(counts) for counts in answers.results.values())

    async def resume(self) -> None:
        """Reopen generation everywhere; re-asked requests proceed."""
        await self._control("resume_generation")

    async def _control(self, verb: str) -> Answers:
        """`verb` on every rollout server; while the health check restarts failed servers, one
        that died or gives no answer is left to it instead of failing the run."""
        if self.health is None or self.pool is None:
            return await self.rollout.control(verb)
        answers = await self.rollout.control(verb, on_error="leave_out")
        for server_id, error in answers.left_out.items():
            if not isinstance(error, (*DEAD_SERVER_ERRORS, NoAnswerError)):
                error.add_note(f"{verb}() on server {server_id!r}")
                raise error
            logger.warning("%s() on server %r: %s: %s; the health check restarts it", verb,
                           server_id, type(error).__name__, error)
        return answers

    async def sleep_rollout(self) -> None:
        """Free the engines' KV cache and weights while the actor trains on the same devices
        (rollout.free_cache_engine, HYBRID only: standalone replicas own their devices). With
        LoRA only the KV cache: the base weights stay, the sync sends only the adapter."""
        if self.layout is ReplicaLayout.HYBRID and self.config.rollout.free_cache_engine:
            tags = ["kv_cache"] if self.config.actor.lora.rank else ["kv_cache", "weights"]
            await self.rollout.control("sleep", tags)

    async def wake_rollout(self, tags: Iterable[str]) -> None:
        """Restore what sleep_rollout() freed, by tag (HYBRID only)."""
        if self.layout is ReplicaLayout.HYBRID:
            await self.rollout.control("wake_up", list(tags))

    async def while_rollout_answers(self, work: Awaitable[T], phase: str) -> T:
        """Await `work` (what the rollout servers produce: the buffer's next groups) while the
        servers are asked weight_version() in turn, each within rollout.checkpoint_engine.
        timeout_s: when none answers, nothing can come, so `work` is cancelled, the servers are
        reported stalled (the balancer stops routing there) and NoAnswerError names the phase
        and every server. A pool that answers, however slowly it generates, is waited for. With
        rollout.fault_tolerance the health check watches instead (wait_for_rollout)."""
        if self.health is not None:  # it restarts stalled servers and fails the run past its budget
            return await self.wait_for_rollout(work)
        timeout_s = self.config.rollout.checkpoint_engine.timeout_s
        task = asyncio.ensure_future(work)
        probe: asyncio.Future | None = None
        try:
            while True:
                probe = asyncio.ensure_future(self.rollout.control(
                    "weight_version", timeout_s=timeout_s, on_error="leave_out"))
                await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                answers = probe.result()
                if not answers.results:
                    raise NoAnswerError(await self._no_rollout_left(phase, answers, timeout_s))
                await asyncio.wait({task}, timeout=min(timeout_s / 4, 5.0))
                if task.done():
                    return task.result()
        finally:
            for pending in (task, probe):
                if pending is not None and not pending.done():
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)

    async def _no_rollout_left(self, phase: str, answers: Any, timeout_s: float) -> str:
        for server_id, error in answers.left_out.items():
            stalled = not isinstance(error, DEAD_SERVER_ERRORS)
            await call(self.rollout.balancer, "report_dead", server_id, 0, stalled)
        servers = "; ".join(f"{sid}: {type(error).__name__}: {error}"
                            for sid, error in answers.left_out.items()) or "none is left"
        return (f"{phase}: no rollout server answered within {timeout_s} s "
                f"(rollout.checkpoint_engine.timeout_s), so no trajectory can come ({servers}); "
                "a server that is stalled (stopped, hung) or dead; the run stops")

    async def sync_weights(self, version: int) -> dict[str, float]:
        """The actor's weights into every engine as `version` through the layout's seam (then
        standalone replicas started since the last sync join); the step's sync metrics."""
        if self.health is not None:
            self.health.raise_if_failed()
        if self.pool is not None:
            report = await self.pool.sync(version)
        else:
            report = await self.weight_sync.sync(version)
        if report.behind():
            logger.warning("servers not on version %d after the sync: %s (left out: %s)",
                           version, report.behind(), report.left_out)
        return report.metrics()

    async def wait_for_rollout(self, work: Awaitable[T]) -> T:
        """Await `work` that needs the rollout's data (a buffer take, a generation), unless the
        health check fails the run first (its failure is raised, naming the server)."""
        if self.health is None:
            return await work
        if self.pool is not None:
            self.pool.awaiting_rollout = True
        try:
            return await self.health.unless_failed(work)
        finally:
            if self.pool is not None:
                self.pool.awaiting_rollout = False

    async def fault_metrics(self) -> dict[str, float]:
        """The step's fault metrics: dead, stalled and restarted servers of the rollout and the
        served rewards, retried requests, the standalone pool's size (fleet/replicas: restarting
        replicas count; serving/servers counts those registered)."""
        metrics = await self.rollout.fault_metrics()
        metrics.update(await self.rewards.fault_metrics())
        if self.pool is not None:
            metrics["fleet/replicas"] = float(self.pool.size())
        if self.health is not None:
            metrics.update(self.health.metrics())
        return metrics

    # ---- the elastic pool (standalone replicas, between steps) -----------------------------

    async def add_replicas(self, count: int) -> list[str]:
        """Start `count` standalone replicas; each serves the trainer's current version before
        its first request (loaded now if the actor holds it, else right after the next sync)."""
        return await self._standalone("add_replicas").add(count)

    async def remove_replicas(self, count: int) -> list[str]:
        """Stop the `count` newest standalone replicas; their running requests continue on the
        others with the tokens they have (remove with abort, drained). At least one stays."""
        return await self._standalone("remove_replicas").remove(count)

    async def follow_schedule(self, step: int) -> None:
        """Resize the standalone pool to rollout.elastic.schedule's size at `step` (call it right
        after the sync of `step`, so added replicas load that version at once)."""
        replicas = scheduled_size(self.config.rollout.elastic.schedule, step)
        if replicas is not None:
            await self._standalone("follow_schedule").resize(replicas)

    async def follow_pressure(self, metrics: dict[str, float] | None) -> None:
        """Resize the standalone pool by rollout.elastic.auto from the last step's idle
        fractions (`metrics`: its record; None before the first step: nothing changes)."""
        auto = self.config.rollout.elastic.auto
        if not auto.enable or metrics is None:
            return
        pool = self._standalone("follow_pressure")
        capacity = replica_count(rollout_devices(self.config),
                                 replica_world_size(self.config.rollout))
        size = pool.size()
        target = pressure_size(size, metrics["idle/trainer_fraction"],
                               metrics["idle/rollout_fraction"], auto, capacity)
        if target != size:
            logger.info("rollout.elastic.auto: trainer idle %.2f, rollout idle %.2f of the last "
                        "step: %d -> %d replicas", metrics["idle/trainer_fraction"],
                        metrics["idle/rollout_fraction"], size, target)
            await pool.resize(target)

    def _standalone(self, what: str) -> RolloutPool:
        if self.pool is None:
            raise RuntimeError(f"{what}: {HYBRID_IS_FATAL}; only standalone replicas (rollout "
                               "devices of their own) are added and removed")
        return self.pool

    async def stop(self) -> None:
        """Stop the servers and workers and free the placement group; leave Ray to its owner."""
        if self.health is not None:
            await self.health.stop()
        await self.rewards.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.rollout is not None:
            await self.rollout.shutdown()
        for worker in self.workers:
            ray.kill(worker)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
