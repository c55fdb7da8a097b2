"""The ranks of a tensor-parallel native replica: rank 0 is the AsyncEngine (it schedules,
samples and answers calls); ranks 1..TP-1 are worker processes that hold their slice of the model
and of the KV cache and run, in lockstep, whatever rank 0 broadcasts. On one host rank 0 spawns
them all; a replica spread over nodes meets at a `Rendezvous` on rank 0's node, where rank 0
spawns the ranks of its node and each other node's server (serving/rank_host.py) spawns its own
(the processes' start, reaping and stop: rank_processes.py).

Rank 0 sends every command to all workers over the replica's gloo group (`RankWorkers`, with
rank_messages.py's broadcasts and replies, under
the engine's step lock, so commands never interleave): a step's plan (they run the same forward,
joining its all-reduces and the logits gather), sleep / wake, KV allocation (in /dev/shm for a
PD replica's shm transfer, whose handoffs each decode rank copies: shared_kv.py), the two phases of
a weight update or an adapter (stage: each rank gets only its slices, point to point, and checks
them, merging an adapter's into its own base slices; then commit or discard on all) or of a flip
to the double-buffered weight slots (map them once; each rank checks and packs its part of the
written slot, then all flip or none), a read of the weights for checks, stop. Replies come back
point to point. A worker that fails exits; its sockets close and rank 0's next collective fails
at once, naming the rank; in a weight update every wait on a rank has the sync's deadline.
"""

from __future__ import annotations

import logging
import os
import subprocess
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from tandem.quiet import quiet_libraries
from tandem.rollout.adapter_stream import peek_stream
from tandem.rollout.base import ReplicaFailedError
from tandem.rollout.engine.lora_merge import LoraState, StagedAdapter, stage_adapter
from tandem.rollout.engine.memory import held_bytes, release_weights, restore_weights
from tandem.rollout.engine.model_runner import ModelRunner, StepPlan, torch_dtype
from tandem.rollout.engine.rank_messages import (broadcast_command, receive_command,
                                                 receive_reply, send_reply, wait_for)
from tandem.rollout.engine.rank_processes import die_with, exit_codes, spawn_workers, terminate
from tandem.rollout.engine.shared_kv import KVMaps, SharedKV, copy_heads
from tandem.rollout.engine.tensor_parallel import TensorParallel, make_groups, rank_devices
from tandem.rollout.engine.slot_weights import flip, map_into, stage_from_slot
from tandem.rollout.engine.weight_staging import (SlotStage, accepted_shapes, install_staged,
                                                  stage_weights)
from tandem.types import WeightPatch
from tandem.weight_layout import Chunk, map_file, view

logger = logging.getLogger(__name__)

# A collective of a step or a weight transfer waits at most this long for a peer (a dead peer
# fails it at once: its sockets close); start-up (spawn, imports, loading) shares it.
COLLECTIVE_TIMEOUT_S = 300.0
# How long a failing replica waits for a worker whose sockets closed to be reaped (to name it).
EXIT_GRACE_S = 1.0
SLICE_TAG = 2  # point-to-point tags: 0 and 1 carry replies, 2.. a weight update's slices
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of a replica spread over nodes meet: the store on rank 0's node
    (`host`:`port`), and how many ranks that node runs (ranks 0..local_ranks-1; the other nodes'
    servers start the rest, each binding its collectives to its own node address)."""

    host: str
    port: int
    local_ranks: int


# ---- ranks 1..TP-1 ------------------------------------------------------------------------
class RankWorker:
    """One worker rank: its runner (its slice of the model and KV cache), what it has staged and
    its adapter state (the base of its merged slices); `serve` executes rank 0's commands until
    told to stop."""

    def __init__(self, runner: ModelRunner, group: Any) -> None:
        self.runner, self.group = runner, group
        self.weights_state = "loaded"  # loaded | offloaded | dropped, as rank 0's
        self.weight_shapes: dict[str, torch.Size] = {}
        self.kv_shape: tuple[int, int] | None = None  # (num_blocks, block_size) when allocated
        self.staged: dict[str, torch.Tensor] | StagedAdapter | None = None
        self.lora = LoraState()  # as rank 0's, for this rank's slices
        self.slot_views: list[dict[str, torch.Tensor]] | None = None  # both weight slots' part
        self.slot_stage: SlotStage | None = None  # checked and packed, to flip to
        self.kv_maps = KVMaps()  # the prefill ranks' KV files a PD decode rank copies from

    def serve(self) -> None:
        while True:
            verb, *arguments = receive_command(self.group)
            if verb == "stop":
                return
            reply = getattr(self, verb)(*arguments)
            if verb != "step":  # a step answers through its collectives
                send_reply(self.group, reply)

    def step(self, plan: StepPlan) -> None:
        for _ in self.runner.forward_layers(plan):
            pass

    def allocate_kv(self, num_blocks: int, block_size: int, shm_dir: str | None = None
                    ) -> dict[str, int]:
        self.runner.kv_shm_dir = shm_dir
        self.runner.allocate_kv_cache(num_blocks, block_size)
        self.kv_shape = (num_blocks, block_size)
        return self.memory_bytes()

    def kv_share(self) -> SharedKV | None:
        cache = self.runner.shared_cache
        return cache.share if cache is not None else None

    def pull_kv(self, shares: list[SharedKV], plans: list[list[tuple[int, int, int]]],
                runs: list[tuple[int, int, int]]) -> int | str:
        """Copy this rank's heads of a handoff's blocks from the prefill ranks' caches
        (shared_kv.py); the bytes moved, or the error (it fails that transfer, not the rank)."""
        try:
            plan = plans[self.runner.tensor_parallel.rank - 1]
            return copy_heads(self.kv_maps.get(shares), plan, self.runner.key_caches,
                              self.runner.value_caches, runs)
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    def sleep(self, tags: list[str]) -> dict[str, int]:
        if "kv_cache" in tags:
            self.runner.free_kv_cache()
            self.kv_maps = KVMaps()  # peers' caches mapped for handoffs: their pages go too
        if "weights" in tags and self.weights_state == "loaded":
            self.weights_state, self.weight_shapes = release_weights(self.runner)
            if self.weights_state == "dropped":  # the refill is a full stream: the new base
                self.lora = LoraState()
            self.slot_views = None
        return self.memory_bytes()

    def wake_up(self, tags: list[str]) -> dict[str, int]:
        if "weights" in tags and self.weights_state != "loaded":
            restore_weights(self.runner, self.weights_state, self.weight_shapes)
            self.weights_state = "loaded"
        if "kv_cache" in tags and not self.runner.key_caches:
            self.runner.allocate_kv_cache(*self.kv_shape)
        return self.memory_bytes()

    def stage(self, headers: dict[int, list[tuple[str, list[tuple[tuple, torch.dtype]]]]],
              version: int) -> str | None:
        """Receive this rank's slices (or a delta's patches of them: index and values) and check
        them like rank 0 does its own, one at a time (a received slice is staged before the next
        arrives; an adapter's slices are merged into this rank's base); returns the error or
        None."""
        def received():
            tag = SLICE_TAG
            for name, parts in headers[self.group.rank()]:
                tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
                for tensor in tensors:
                    self.group.recv([tensor], 0, tag).wait()
                    tag += 1
                yield name, tensors[0] if len(tensors) == 1 else WeightPatch(*tensors)

        stream = received()
        try:
            adapter, whole = peek_stream(stream)
            shapes = accepted_shapes(self.runner)
            self.staged = (stage_adapter(self.runner, shapes, whole, self.lora) if adapter
                           else stage_weights(self.runner, shapes, whole or (), version))
        except Exception as error:  # reported to rank 0, which discards the update everywhere
            self.staged = None
            for _ in stream:  # every send of rank 0 must still complete
                pass
            return f"{type(error).__name__}: {error}"
        return None

    def commit(self, install: bool) -> dict[str, int]:
        if install:
            staged = self.staged
            install_staged(self.runner,
                           staged.weights if isinstance(staged, StagedAdapter) else staged)
            self.lora.record(self.staged)
            if self.runner.tied_lm_head:  # now rather than at the next step: the report counts it
                self.runner.refresh_tied_lm_head()
            self.slot_views = None  # the weights are fresh tensors, no slot's views
        self.staged = None
        return self.memory_bytes()

    def map_slots(self, paths: tuple[str, str], nbytes: int, entries: dict[int, list[Chunk]],
                  active: int) -> dict[str, int]:
        """Map the replica's two weight slot files, copy this rank's weights into its entries
        of slot `active` and serve dense weights from them."""
        slots = [map_file(path, nbytes) for path in paths]
        own = entries[self.group.rank()]
        self.slot_views = [{entry.name: view(slot, entry) for entry in own} for slot in slots]
        map_into(self.runner, self.slot_views[active])
        return self.memory_bytes()

    def stage_slot(self, index: int, version: int) -> str | None:
        """Check this rank's part of the written slot `index` and pack from it; the error or None."""
        views = self.slot_views[index]
        try:
            self.slot_stage = stage_from_slot(self.runner, accepted_shapes(self.runner),
                                              views.items(), views, index, version)
        except Exception as error:  # reported to rank 0: no rank flips
            self.slot_stage = None
            return f"{type(error).__name__}: {error}"
        return None

    def flip(self, install: bool) -> dict[str, int]:
        """Serve the staged slot (install) or forget it; every rank gets the same command."""
        if install:
            flip(self.runner, self.slot_stage, self.slot_views[self.slot_stage.index])
        self.slot_stage = None
        return self.memory_bytes()

    def values(self, name: str, positions: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """This rank's slice of `name` at its flat positions, if it was asked."""
        local = positions.get(self.group.rank())
        if local is None:
            return None
        return self.runner.dense_weight(name).reshape(-1).index_select(
            0, local.to(self.runner.device)).cpu()

    def weights(self, names: list[str] | None) -> dict[str, torch.Tensor]:
        """Host copies of this rank's slices (all weights when `names` is None)."""
        names = list(accepted_shapes(self.runner)) if names is None else names
        return {name: self.runner.dense_weight(name).to("cpu", copy=True) for name in names}

    def memory_bytes(self) -> dict[str, int]:
        return held_bytes(self.runner)


def run_worker(rank: int, size: int, store_host: str, port: int, model_path: str, dtype: str,
               device: str, shared_device: bool, threads: int | None, parent: int,
               bind_host: str = LOOPBACK) -> None:
    """A worker process's main: join the replica's groups, load this rank's slice, report, then
    serve rank 0's commands. Any failure ends the process (rank 0 sees its sockets close)."""
    die_with(parent)
    quiet_libraries()
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(store_host, port, size, is_master=False, timeout=timeout)
    control, compute = make_groups(store, rank, size, device, timeout, shared_device, bind_host)
    try:
        runner = ModelRunner(model_path, torch_dtype(dtype), device,
                             TensorParallel(rank, size, compute))
    except Exception as error:
        send_reply(control, f"{type(error).__name__}: {error}")
        raise
    send_reply(control, None)
    try:
        RankWorker(runner, control).serve()
    except Exception:
        traceback.print_exc()
        os._exit(1)  # the sockets close: rank 0's next collective fails instead of waiting


# ---- rank 0 -------------------------------------------------------------------------------
class RankWorkers:
    """Rank 0's handle on the worker ranks: every call broadcasts one command and, except a
    step, collects each worker's reply. Call only under the engine's step lock (or before the
    engine loop runs)."""

    def __init__(self, processes: list[subprocess.Popen], group: Any, store: dist.Store,
                 threads_before: int, size: int) -> None:
        self.processes, self.group, self.size = processes, group, size  # processes: this node's
        self.store = store  # the rendezvous server lives as long as the groups
        self.threads_before = threads_before  # this process's torch threads, restored at stop
        self.memory = [{"weights": 0, "kv_cache": 0} for _ in range(size - 1)]  # as last replied
        self.failure: str | None = None  # set once a rank failed: the replica cannot step
        self._finalizer = weakref.finalize(self, terminate, processes)

    @classmethod
    def start(cls, size: int, model_path: str, dtype: str, device: torch.device,
              rendezvous: Rendezvous | None = None) -> tuple["RankWorkers", TensorParallel]:
        """Spawn this node's ranks 1.. (all of 1..size-1 without a rendezvous) and join every
        rank's groups; returns the handle and rank 0's TensorParallel (the workers load their
        slices while rank 0 loads its own). On CPU each local rank, this process included, takes
        1/(local ranks) of this process's torch threads."""
        local = size if rendezvous is None else rendezvous.local_ranks
        host = LOOPBACK if rendezvous is None else rendezvous.host
        threads_before, threads = torch.get_num_threads(), None
        if device.type == "cpu":
            threads = max(1, threads_before // local)
            torch.set_num_threads(threads)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore(host, 0 if rendezvous is None else rendezvous.port, size,
                              is_master=True, wait_for_workers=False, timeout=timeout)
        devices = rank_devices(device, local)
        shared = device.type == "cuda" and len(set(devices)) < local
        processes = spawn_workers(range(1, local), size, host, store.port, model_path, dtype,
                                  devices[1:], shared, threads, host)
        try:
            control, compute = make_groups(store, 0, size, devices[0], timeout, shared, host)
        except Exception:
            terminate(processes)
            torch.set_num_threads(threads_before)
            raise
        return (cls(processes, control, store, threads_before, size),
                TensorParallel(0, size, compute))

    def wait_ready(self) -> None:
        """After rank 0 loaded its slice: every worker's start-up report."""
        errors = {rank: self._reply(rank) for rank in range(1, self.size)}
        failed = {rank: error for rank, error in errors.items() if error}
        if failed:
            raise RuntimeError(f"tensor-parallel ranks failed to start: {failed}")

    def step(self, plan: StepPlan) -> None:
        self._command("step", plan)

    def allocate_kv(self, num_blocks: int, block_size: int, shm_dir: str | None = None) -> None:
        self._fan_out("allocate_kv", num_blocks, block_size, shm_dir)

    def kv_shares(self) -> list[SharedKV | None]:
        """Where each worker's KV cache lies (None: not in shared memory)."""
        return self._fan_out("kv_share")

    def pull_kv(self, shares: list[SharedKV], plans: list[list[tuple[int, int, int]]],
                runs: list[tuple[int, int, int]], local: Callable[[], int]) -> int:
        """Every worker copies its heads of a handoff (`plans[rank - 1]`) while this rank runs
        `local` (its own copy); the bytes moved by all."""
        self._command("pull_kv", shares, plans, runs)
        try:
            moved = local()
        finally:  # the workers' replies are read even when this rank's copy failed
            replies = [self._reply(rank) for rank in range(1, self.size)]
        failed = {rank: reply for rank, reply in enumerate(replies, 1) if isinstance(reply, str)}
        if failed:
            raise RuntimeError(f"KV transfer failed on decode rank(s) {failed}")
        return moved + sum(replies)

    def sleep(self, tags: list[str]) -> None:
        self._fan_out("sleep", tags)

    def wake_up(self, tags: list[str]) -> None:
        self._fan_out("wake_up", tags)

    def stage(self, slices: list[dict[str, torch.Tensor | WeightPatch]], version: int,
              timeout_s: float | None = None) -> None:
        """Phase one of an update: each worker gets its slices (`slices[rank - 1]`; a delta's
        patches of them travel as index and values) and checks
        them. If any refuses, all discard (phase two with install=False) and this raises,
        naming the ranks: every rank stays on the old version. Every wait is bounded by
        `timeout_s` (a sync's deadline); a rank that misses it fails the replica, named."""
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        wire = [{name: _wire_parts(item) for name, item in part.items()} for part in slices]
        headers = {rank: [(name, [(tuple(t.shape), t.dtype) for t in parts])
                          for name, parts in part.items()]
                   for rank, part in enumerate(wire, start=1)}
        self._command("stage", headers, version, timeout=timeout)
        works = [(rank, self.group.send([tensor], rank, tag))
                 for rank, part in enumerate(wire, start=1)
                 for tag, tensor in enumerate((t for parts in part.values() for t in parts),
                                              start=SLICE_TAG)]
        for rank, work in works:
            try:
                wait_for(work, timeout)
            except Exception as error:
                raise self.fail(error, [rank], timeout) from error
        errors = {rank: self._reply(rank, timeout) for rank in headers}
        failed = {rank: error for rank, error in errors.items() if error}
        if failed:
            self._fan_out("commit", False, timeout=timeout)
            raise ValueError(f"update_weights: tensor-parallel rank(s) refused their slices "
                             f"{failed}; every rank keeps version {version}")

    def map_slots(self, paths: tuple[str, str], nbytes: int, entries: dict[int, list[Chunk]],
                  active: int) -> None:
        """Every worker maps the replica's weight slots and serves from slot `active`."""
        self._fan_out("map_slots", paths, nbytes, entries, active)

    def stage_slot(self, index: int, version: int, timeout_s: float | None = None) -> None:
        """Phase one of a flip: every worker checks its part of slot `index` and packs from it.
        If any refuses, all forget it and this raises, naming the ranks: no rank flips."""
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._command("stage_slot", index, version, timeout=timeout)
        errors = {rank: self._reply(rank, timeout) for rank in range(1, self.size)}
        failed = {rank: error for rank, error in errors.items() if error}
        if failed:
            self._fan_out("flip", False, timeout=timeout)
            raise ValueError(f"update_weights: tensor-parallel rank(s) refused their part of "
                             f"weight slot {index} {failed}; every rank keeps version {version}")

    def flip(self, timeout_s: float | None = None) -> None:
        """Phase two: every worker serves the slot it staged."""
        self._fan_out("flip", True,
                      timeout=None if timeout_s is None else timedelta(seconds=timeout_s))

    def commit(self, timeout_s: float | None = None) -> None:
        """Phase two: every worker installs what it staged (each wait bounded by `timeout_s`)."""
        self._fan_out("commit", True,
                      timeout=None if timeout_s is None else timedelta(seconds=timeout_s))

    def weights(self, names: list[str] | None = None) -> list[dict[str, torch.Tensor]]:
        """Each worker's slices (for checks), ranks 1.. in order."""
        return self._fan_out("weights", names)

    def values(self, name: str, positions: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """Each worker's values of its slice of `name` at its flat `positions[rank]` (None for
        a rank not asked), ranks 1.. in order (a delta sync's check)."""
        return self._fan_out("values", name, positions)

    def stop(self, gracefully: bool = True, timeout_s: float = 30.0) -> None:
        """Tell every worker to exit and wait for it; one that does not, or every one when not
        `gracefully` (a failed start: a worker may be blocked sending its report), is killed."""
        if gracefully and self.failure is None:
            try:
                broadcast_command(self.group, ("stop",), timedelta(seconds=timeout_s))
                for process in self.processes:
                    process.wait(timeout_s)
            except Exception:  # a dead or stuck peer: terminated below
                pass
        self._finalizer()
        torch.set_num_threads(self.threads_before)

    def _fan_out(self, verb: str, *arguments: Any, timeout: timedelta | None = None
                 ) -> list[Any]:
        self._command(verb, *arguments, timeout=timeout)
        replies = [self._reply(rank, timeout) for rank in range(1, self.size)]
        if verb not in ("weights", "values", "kv_share", "pull_kv"):  # the rest: their memory
            self.memory = replies
        return replies

    def _command(self, verb: str, *arguments: Any, timeout: timedelta | None = None) -> None:
        if self.failure is not None:
            raise ReplicaFailedError(self.failure)
        try:
            broadcast_command(self.group, (verb, *arguments), timeout)
        except Exception as error:  # which rank did not take it is unknown: name them all
            raise self.fail(error, list(range(1, self.size)), timeout) from error

    def _reply(self, rank: int, timeout: timedelta | None = None) -> Any:
        try:
            return receive_reply(self.group, rank, timeout)
        except Exception as error:
            raise self.fail(error, [rank], timeout) from error

    def fail(self, error: BaseException, waited_on: list[int] | None = None,
             timeout: timedelta | None = None) -> ReplicaFailedError:
        """Mark the replica failed (a rank died or a collective broke: the ranks are no longer
        in lockstep) and return the error to raise, naming the ranks that exited, else the ones
        rank 0 was waiting on."""
        exited = exit_codes(self.processes, EXIT_GRACE_S)
        if exited:
            culprits = ", ".join(f"rank {rank} exited (code {code})"
                                 for rank, code in exited.items())
        elif waited_on:
            within = f" within {timeout.total_seconds()} s" if timeout is not None else ""
            culprits = (f"rank {', '.join(map(str, waited_on))} did not answer{within} "
                        "(no rank exited)")
        else:
            culprits = "no rank exited"
        self.failure = (f"tensor-parallel replica failed: {culprits} ({type(error).__name__}: "
                        f"{error}); the replica must be restarted")
        return ReplicaFailedError(self.failure)


def _wire_parts(item: torch.Tensor | WeightPatch) -> list[torch.Tensor]:
    """The tensors a slice travels as: itself, or a patch's index and values."""
    if isinstance(item, WeightPatch):
        return [item.index.contiguous(), item.values.contiguous()]
    return [item]
