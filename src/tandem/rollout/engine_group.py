"""Several native engines served as one replica, behind its one address: the parts common to a
data-parallel replica (rollout/data_parallel.py) and a prefill/decode one
(rollout/disaggregated.py), which say where a request runs.

The engines live in the replica's server process, each on its own device(s) where the node has
enough (CUDA), else sharing one; their steps take turns on the server's event loop, so they do not
overlap (on CPU such a replica is correct, not faster). Control verbs reach every engine; a
weight update is copied once from the stream, staged (checked) into each engine and committed
into each in turn: a refusal by the first installs nothing anywhere, a later one marks the
replica failed (ReplicaFailedError: the fleet takes it out, rollout.fault_tolerance restarts
it), so two versions never serve together.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Iterable

import torch

from tandem.rollout.base import MEMORY_TAGS, BaseRollout, ReplicaFailedError
from tandem.rollout.native import NativeRollout
from tandem.types import WeightPatch

MAX_STICKY = 100_000  # request ids remembered for routing (LRU)


def engine_devices(device: str, count: int, width: int = 1) -> list[str]:
    """The first device of each of `count` engines of `width` devices: consecutive CUDA devices
    from `device`'s when enough are visible, else all on `device` (CPU, or a test layout on one
    GPU)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return [device] * count
    first = torch.device(device).index or 0
    if first + count * width > torch.cuda.device_count():
        return [device] * count
    return [f"cuda:{first + index * width}" for index in range(count)]


def stop_started(engines: list[NativeRollout]) -> None:
    """Stop the worker ranks of engines built before a failed start (their processes)."""
    for engine in engines:
        if engine.ranks is not None:
            engine.ranks.stop(gracefully=False)


class EngineGroup(BaseRollout):
    """Native engines behind one replica address; subclasses route `generate`."""

    capabilities = NativeRollout.capabilities
    kind = "multi-engine"  # named in errors

    def __init__(self, engines: list[NativeRollout]) -> None:
        self.engines = list(engines)
        self.failure: str | None = None
        self._sticky: OrderedDict[str, int] = OrderedDict()  # request id -> engine index
        self._sessions = [0] * len(self.engines)  # request ids each was given

    def route(self, request_id: str, candidates: list[NativeRollout]) -> NativeRollout:
        """The engine of `candidates` this request id ran on before (sticky, so a session's
        earlier turns are in its prefix cache), else the one with the fewest requests in flight
        (then the fewest request ids so far)."""
        index = self._sticky.get(request_id)
        if index is None or index >= len(candidates):
            loads = [(len(engine.requests), self._sessions[self.engines.index(engine)])
                     for engine in candidates]
            index = loads.index(min(loads))
            self._sessions[self.engines.index(candidates[index])] += 1
        self._sticky[request_id] = index
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)
        return candidates[index]

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(engine.abort(request_id) for engine in self.engines))

    async def abort_all(self) -> None:
        await asyncio.gather(*(engine.abort_all() for engine in self.engines))

    # ---- memory ---------------------------------------------------------------------------
    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.sleep(tags) for engine in self.engines))

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.wake_up(tags) for engine in self.engines))

    async def clear_kv_cache(self) -> None:
        await asyncio.gather(*(engine.clear_kv_cache() for engine in self.engines))

    def memory_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for engine in self.engines:
            for key, value in engine.memory_bytes().items():
                total[key] = total.get(key, 0) + value
        return total

    # ---- weights --------------------------------------------------------------------------
    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        """Stage one stream into every engine: it is copied once (a transport's buffers are
        reused as it advances), then each engine checks and stages the copy."""
        stream = [(name, item if isinstance(item, WeightPatch) else item.detach().clone())
                  for name, item in named_tensors]
        return [engine.stage_weights(iter(stream)) for engine in self.engines]

    async def commit_weights(self, staged: list[Any], version: int, partial: bool = False
                             ) -> float:
        """Commit every engine's staged update; the first refusal raises with nothing
        installed anywhere, a later one takes the replica out (its engines now differ)."""
        stood_still = 0.0
        for index, (engine, part) in enumerate(zip(self.engines, staged)):
            try:
                stood_still += await engine.commit_weights(part, version, partial)
            except Exception as error:
                if index:
                    self.failure = (f"{self.kind} replica failed: engine {index} refused "
                                    f"version {version} after engine 0 took it ({error}); the "
                                    "replica must be restarted")
                    raise ReplicaFailedError(self.failure) from error
                raise
        return stood_still

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        await self.commit_weights(self.stage_weights(named_tensors), version, partial)

    def current_weight(self, name: str) -> torch.Tensor:
        return self.engines[0].current_weight(name)

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The values at `index`, the same in every engine (a delta's check; engines that
        differ there are refused: a patch would leave them different)."""
        values = [engine.current_values(name, index) for engine in self.engines]
        if any(not torch.equal(values[0], other) for other in values[1:]):
            raise ValueError(f"current_values: the {self.kind} replica's engines hold "
                             f"different values of {name!r}; a full sync makes them equal")
        return values[0]

    def patches_in_place(self, name: str) -> bool:
        return self.engines[0].patches_in_place(name)

    @property
    def weight_version(self) -> int:
        self.raise_if_failed()
        return self.engines[0].weight_version

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ReplicaFailedError(self.failure)
        for engine in self.engines:
            engine.raise_if_failed()

    def stats(self) -> dict[str, Any]:
        """Every engine's counters summed (the earliest first_token_time)."""
        total: dict[str, Any] = {"replica_engines": len(self.engines)}
        for engine in self.engines:
            for key, value in engine.stats().items():
                if key == "first_token_time":  # the earliest engine's
                    times = [t for t in (total.get(key), value) if t is not None]
                    total[key] = min(times) if times else None
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                elif total.get(key) is None:
                    total[key] = value
        return total

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))
