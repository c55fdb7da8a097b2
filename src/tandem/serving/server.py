"""The rollout server: one process hosting one backend engine (any registered BaseRollout).

`RolloutServer` is a plain class with async methods; `RolloutServerActor` is the same class as a
Ray async actor. A hybrid training worker subclasses it so that its own process hosts the engine.
While the server is paused or asleep a new generate() waits until generation is open again (up
to `pause_timeout_s`), so an aborted request re-asks at once and simply waits; a server taken
out of the balancer answers "aborted" at once instead (docs/serving.md, "The generation gate").
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import ray
import torch

from tandem.config.schema import RolloutConfig
from tandem.quiet import quiet_libraries
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, check_tags
from tandem.rollout.engine.rank_worker import Rendezvous
from tandem.types import GenerateRequest, TokenOutput
from tandem.weight_sync.base import SyncPlan
from tandem.weight_sync.participants import receive_into
from tandem.weight_sync.slots import SlotsDescriptor, WeightSlots, make_layout, slots_fit

logger = logging.getLogger(__name__)

# How often abort_all_requests() re-issues the backend abort while calls are still returning.
_ABORT_POLL_S = 0.05
# The verbs the trainer, the weight-sync seam and spillover send to servers (ServerManager.control,
# the one fan-out): a new one is a method of RolloutServer (and, if the engine does it, of
# BaseRollout) named here. Weights are no verb: they move only through the seam.
CONTROL_VERBS = ("abort_all_requests", "resume_generation", "sleep", "wake_up",
                 "release_kv_cache", "resume_kv_cache", "clear_kv_cache", "weight_slots",
                 "weight_version", "synced_in_full", "stats", "info", "shutdown")


@dataclass
class ServerInfo:
    """Where a server runs and what it hosts."""

    server_id: str
    backend: str  # the backend class name
    node_ip: str
    node_id: str | None  # the Ray node (None outside Ray): "same host" for transports
    pid: int
    placement_group_id: str | None  # hex id when placed in a Ray placement group
    weight_version: int
    niceness: int  # CPU priority of the process (Ray's default for workers is 15)
    torch_threads: int  # torch.get_num_threads() of the engine's thread

    @property
    def address(self) -> str:
        """node_ip:pid, unique per server process on a cluster."""
        return f"{self.node_ip}:{self.pid}"


class RolloutServer:
    """Hosts one backend; gates generation while paused or asleep; counts what it served."""

    def __init__(self, server_id: str = "server", pause_timeout_s: float = 3600.0,
                 drain_timeout_s: float = 60.0) -> None:
        self._init_rollout_server(server_id, pause_timeout_s, drain_timeout_s)

    def _init_rollout_server(self, server_id: str, pause_timeout_s: float,
                             drain_timeout_s: float) -> None:
        """Initialise the serving state; subclasses with their own __init__ call this."""
        self.server_id = server_id
        self.pause_timeout_s = pause_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._backend: BaseRollout | None = None
        self._device = "cpu"
        self._paused = False
        self._rerouting = False  # removed from the balancer: late calls return "aborted" at once
        self._asleep: set[str] = set()
        self._open = asyncio.Event()  # set iff generation may start now
        self._idle = asyncio.Event()  # set iff no generate() call is inside the backend
        self._idle.set()
        self._generating = 0
        self._sync: dict[str, Any] | None = None  # the sync being received: version, progress
        self._slots: WeightSlots | None = None  # the engine's two weight slots, once made
        self._counts = {"requests": 0, "completed": 0, "aborted": 0, "failed": 0, "cancelled": 0,
                        "tokens": 0}

    async def start(self, backend_class: type[BaseRollout], model_path: str | Path,
                    config: RolloutConfig, dtype: str = "float32", device: str = "cpu",
                    torch_threads: int | None = None,
                    rendezvous: Rendezvous | None = None) -> ServerInfo:
        """Create the backend in this process and open generation; returns where it runs.
        `rendezvous`: this server is node-rank 0 of a native replica spread over nodes."""
        if self._backend is not None:
            raise RuntimeError(f"server {self.server_id!r} already hosts a backend")
        quiet_libraries()  # no per-load progress bar from this process in the driver's log
        if torch_threads is not None:
            # Ray sets OMP_NUM_THREADS=1 in actors with fractional CPUs; CPU engines need more.
            torch.set_num_threads(torch_threads)
        spread = {} if rendezvous is None else {"rendezvous": rendezvous}
        self._backend = backend_class.create(model_path, config, dtype=dtype, device=device,
                                             **spread)
        self._device = device
        self._update_gate()
        info = self.info()
        if info.niceness > 0 and device == "cpu":
            logger.warning("rollout server %s runs at nice %d and gets less CPU than the trainer "
                           "on a busy machine; start Ray with _system_config={'worker_niceness': 0}"
                           " (or RAY_worker_niceness=0)", self.server_id, info.niceness)
        return info

    @property
    def backend(self) -> BaseRollout:
        """The hosted engine (in-process callers may drive it directly, e.g. naive weight sync)."""
        if self._backend is None:
            raise RuntimeError(f"server {self.server_id!r} has no backend yet: call start() first")
        return self._backend

    def rendezvous_point(self, local_ranks: int) -> Rendezvous:
        """Where the ranks of a replica spread over nodes meet: this node's address and a port
        free on it now, for the store rank 0 opens there; this node runs `local_ranks`."""
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as probe:
            probe.bind((host, 0))
            return Rendezvous(host, probe.getsockname()[1], local_ranks)

    def info(self) -> ServerInfo:
        """Node, process, placement group and weight version of this server."""
        placement_group_id = node_id = None
        if ray.is_initialized():
            context = ray.get_runtime_context()
            placement_group_id, node_id = context.get_placement_group_id(), context.get_node_id()
        return ServerInfo(self.server_id, type(self.backend).__name__,
                          ray.util.get_node_ip_address(), node_id, os.getpid(),
                          placement_group_id, self.backend.weight_version, os.nice(0),
                          torch.get_num_threads())

    def stats(self) -> dict[str, Any]:
        """Server counters (requests by outcome, tokens returned) plus the backend's own."""
        backend_stats = getattr(self.backend, "stats", None)
        return {**self._counts, "generating": self._generating, "paused": self._paused,
                "asleep": sorted(self._asleep), "weight_version": self.backend.weight_version,
                "sync": dict(self._sync) if self._sync is not None else None,
                "backend": backend_stats() if callable(backend_stats) else {}}

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Generate through the backend once generation is open (waits while paused/asleep)."""
        backend = self.backend
        type(backend).check_request(request, self._device)
        await self._wait_open()
        if self._rerouting:
            self._counts["aborted"] += 1
            return TokenOutput([], [] if request.sampling.get("logprobs", True) else None,
                               "aborted", {"global_steps": backend.weight_version})
        self._generating += 1
        self._idle.clear()
        self._counts["requests"] += 1
        try:
            output = await backend.generate(request)
        except asyncio.CancelledError:
            self._counts["cancelled"] += 1
            await backend.abort(request.request_id)  # the caller is gone: free the engine's work
            raise
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            self._generating -= 1
            if self._generating == 0:
                self._idle.set()
        self._counts["aborted" if output.stop_reason == "aborted" else "completed"] += 1
        self._counts["tokens"] += len(output.token_ids)
        return output

    async def _wait_open(self) -> None:
        deadline = time.monotonic() + self.pause_timeout_s
        while not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"server {self.server_id!r}: generation stayed closed (paused="
                    f"{self._paused}, asleep={sorted(self._asleep)}) for {self.pause_timeout_s} s;"
                    " the trainer must call resume_generation() / wake_up()") from None

    def _update_gate(self) -> None:
        if self._rerouting or (self._backend is not None and not self._paused and not self._asleep):
            self._open.set()
        else:
            self._open.clear()

    def _require_quiet(self, action: str) -> None:
        if self._generating:
            raise RuntimeError(f"server {self.server_id!r}: {action} while {self._generating} "
                               "request(s) are generating; call abort_all_requests() first")

    async def abort_all_requests(self, reroute: bool = False) -> int:
        """Pause generation and abort every running request; returns how many were running, once
        every aborted call has come back. With reroute (the server left the balancer) later calls
        are answered "aborted" at once, until resume_generation()."""
        backend = self.backend
        self._paused = True
        self._rerouting = self._rerouting or reroute
        self._update_gate()
        running = self._generating
        deadline = time.monotonic() + self.drain_timeout_s
        while self._generating:
            # Re-issued until drained: a request the engine had not registered yet is caught too.
            await backend.abort_all()
            try:
                await asyncio.wait_for(self._idle.wait(), _ABORT_POLL_S)
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {self.server_id!r}: {self._generating} request(s)"
                                       f" still generating {self.drain_timeout_s} s after "
                                       "abort_all_requests(); the backend ignores abort") from None
        return running

    async def resume_generation(self) -> None:
        """Reopen generation after abort_all_requests(); waiting calls proceed."""
        self._paused = False
        self._rerouting = False
        self._update_gate()

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Release the tagged memory; generation stays closed until wake_up() of those tags."""
        tags = check_tags(tags)
        self._require_quiet(f"sleep({tags})")
        self._asleep.update(tags)
        self._update_gate()
        await self.backend.sleep(tags)

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Restore the tagged memory; generation reopens when nothing is asleep or paused."""
        tags = check_tags(tags)
        await self.backend.wake_up(tags)
        self._asleep.difference_update(tags)
        self._update_gate()

    async def release_kv_cache(self) -> None:
        """Free only the KV cache (weight-sync critical section); abort_all_requests() first."""
        self._require_quiet("release_kv_cache()")
        self._asleep.add("kv_cache")
        self._update_gate()
        await self.backend.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache freed by release_kv_cache()."""
        await self.backend.resume_kv_cache()
        self._asleep.discard("kv_cache")
        self._update_gate()

    async def clear_kv_cache(self) -> None:
        """Drop every cached prefix block."""
        await self.backend.clear_kv_cache()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        """Load (name, tensor) pairs (one bucket or all) and stamp `version` on later tokens: the
        in-process end of the seam (the naive checkpoint engine of a hybrid worker); `partial`:
        the stream leaves some weights out (BaseRollout.update_weights)."""
        self._require_quiet("update_weights()")
        await self.backend.update_weights(named_tensors, version, partial)

    async def synced_in_full(self) -> bool:
        """Whether the engine holds every weight, so a sync may leave frozen ones out."""
        return self.backend.synced_in_full()

    async def receive_weights(self, plan: SyncPlan, rank: int,
                              engine_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
        """Join a cross-process weight sync as receiver `rank` of `plan` (the sync manager calls
        it after abort_all_requests() and release_kv_cache()). The whole stream is staged and
        checked before it is swapped in, so a failure (WeightSyncError naming the phase) leaves
        the engine serving its previous version. Returns seconds per phase and the version."""
        if "slots" not in plan.details:  # double-buffered syncs run while generation goes on
            self._require_quiet("receive_weights()")
        if self._sync is not None:
            raise RuntimeError(f"server {self.server_id!r} is already receiving version "
                               f"{self._sync['version']}")
        self._sync = {"version": plan.version}
        try:
            timings = await receive_into(self.backend, plan, rank, f"server {self.server_id!r}",
                                         engine_kwargs, self._sync)
        finally:
            self._sync = None
        return {**timings, "version": self.backend.weight_version}

    async def weight_slots(self, engine_kwargs: dict[str, Any] | None = None
                           ) -> SlotsDescriptor | None:
        """The engine's two weight slots for a double-buffered shm sync (made, and the weights
        copied into one, on first use); None where the engine cannot serve from slots or two
        copies do not fit, unless engine_kwargs.double_buffer is true: then a ValueError."""
        kwargs = engine_kwargs or {}
        wanted = kwargs.get("double_buffer")
        if wanted is False:
            return None
        field_name = "rollout.checkpoint_engine.engine_kwargs.double_buffer"
        specs = self.backend.weight_slot_specs()
        if specs is None:
            if wanted:
                raise ValueError(f"{field_name} is true, but server {self.server_id!r}'s "
                                 f"{type(self.backend).__name__} cannot serve from weight slots "
                                 "(a CUDA or non-native engine, or its weights asleep); set it "
                                 "false")
            return None
        layout = make_layout(*specs)
        if self._slots is None or self._slots.layout != layout:
            shm_dir = kwargs.get("shm_dir", "/dev/shm")
            problem = slots_fit(layout.nbytes, shm_dir)
            if problem:
                if wanted:
                    raise ValueError(f"{field_name} is true, but {problem}; set it false (one "
                                     "copy, generation paused for the load) or free memory")
                logger.warning("server %s: no double buffer (%s); shm syncs pause generation "
                               "for the load", self.server_id, problem)
                return None
            if self._slots is not None:
                self._slots.close()
            self._slots = WeightSlots(layout, shm_dir)
        if self.backend.weight_slot_active is None:
            files = (tuple(self._slots.paths), list(layout.entries), layout.nbytes)
            await self.backend.map_weight_slots([self._slots.views(0), self._slots.views(1)], 0,
                                                files)
        return self._slots.descriptor(self.backend.weight_slot_active)

    async def weight_version(self) -> int:
        """The version stamped on tokens generated now (the health probe: ReplicaFailedError
        when the engine can no longer serve)."""
        self.backend.raise_if_failed()
        return self.backend.weight_version

    async def shutdown(self) -> None:
        """Stop the backend; the server cannot generate afterwards."""
        if self._backend is not None:
            self._paused = True
            self._update_gate()
            await self._backend.shutdown()
        if self._slots is not None:
            self._slots.close()
            self._slots = None


# Calls must overlap (generate waits, abort arrives): an async actor with room for many of them.
RolloutServerActor = ray.remote(max_concurrency=10_000)(RolloutServer)
