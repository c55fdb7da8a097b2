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

An engine that stops (shut down, or its tensor-parallel ranks failed) is lost for good: it gets
no more requests, controls or weights, and the requests it was serving run again on the
engines left (`serve`: the tokens it produced are dropped, never returned, so none is lost or
returned twice). The replica fails only when no engine is left to serve (the fleet's restart
then brings every engine back).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Iterable

import torch

from tandem.rollout.base import MEMORY_TAGS, BaseRollout, ReplicaFailedError
from tandem.rollout.native import NativeRollout
from tandem.types import TokenOutput, WeightPatch

logger = logging.getLogger(__name__)
MAX_STICKY = 100_000  # request ids remembered for routing (LRU)


def engine_devices(device: str, widths: list[int]) -> list[str]:
    """The first device of each engine, of `widths[i]` devices each: consecutive CUDA devices
    from `device`'s when enough are visible, else all on `device` (CPU, or a test layout on one
    GPU)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return [device] * len(widths)
    first = torch.device(device).index or 0
    if first + sum(widths) > torch.cuda.device_count():
        return [device] * len(widths)
    starts = [first + sum(widths[:index]) for index in range(len(widths))]
    return [f"cuda:{start}" for start in starts]


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
        self.lost: dict[int, str] = {}  # engine index -> why it stopped serving
        self.requests_moved = 0  # requests run again elsewhere after their engine was lost
        self.closing = False
        self._aborted: set[str] = set()  # request ids the caller aborted while they ran
        self._abort_epoch = 0  # abort_all calls so far
        self._sticky: OrderedDict[str, int] = OrderedDict()  # request id -> engine index
        self._sessions = [0] * len(self.engines)  # request ids each was given

    def live(self, engines: Iterable[NativeRollout] | None = None) -> list[NativeRollout]:
        """The engines of `engines` (default all) still serving; one found stopped (shut down,
        its tensor-parallel ranks failed) is recorded as lost."""
        for index, engine in enumerate(self.engines):
            if index not in self.lost and not self.closing:
                why = _stopped(engine)
                if why is not None:
                    self.lost[index] = why
                    logger.warning("%s replica: engine %d lost (%s); its requests run on the "
                                   "engines left", self.kind, index, why)
                    if engine.ranks is not None:  # its surviving rank processes hold memory
                        engine.ranks.stop(gracefully=False)
        chosen = self.engines if engines is None else list(engines)
        return [engine for engine in chosen if self.engines.index(engine) not in self.lost]

    def route(self, request_id: str, candidates: list[NativeRollout]) -> NativeRollout:
        """The engine of `candidates` this request id ran on before (sticky, so a session's
        earlier turns are in its prefix cache), else the one with the fewest requests in flight
        (then the fewest request ids so far)."""
        index = self._sticky.get(request_id)
        if index is None or self.engines[index] not in candidates:
            loads = [(len(engine.requests), self._sessions[self.engines.index(engine)])
                     for engine in candidates]
            index = self.engines.index(candidates[loads.index(min(loads))])
            self._sessions[index] += 1
        self._sticky[request_id] = index
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)
        return self.engines[index]

    async def serve(self, request_id: str, candidates: list[NativeRollout],
                    run: Callable[[NativeRollout], Awaitable[TokenOutput]]) -> TokenOutput:
        """`run` on the routed engine of `candidates`; when that engine is lost meanwhile (the
        call fails or comes back aborted because it stopped), again on another, until none is
        left (ReplicaFailedError). A failure of a live engine is the request's, raised as is;
        an aborted output is returned as is when the caller aborted the request meanwhile."""
        tried: list[NativeRollout] = []
        epoch = self._abort_epoch
        try:
            return await self._serve(request_id, candidates, run, tried, epoch)
        finally:
            self._aborted.discard(request_id)

    async def _serve(self, request_id: str, candidates: list[NativeRollout],
                     run: Callable[[NativeRollout], Awaitable[TokenOutput]],
                     tried: list[NativeRollout], epoch: int) -> TokenOutput:
        while True:
            left = [engine for engine in self.live(candidates) if engine not in tried]
            if not left:
                self.raise_if_failed()
                raise ReplicaFailedError(f"{self.kind} replica: no engine left to serve request "
                                         f"{request_id!r}; lost: {self._lost_summary()}")
            engine = self.route(request_id, left)
            try:
                output = await run(engine)
            except Exception:
                if self.closing or engine in self.live([engine]):
                    raise
            else:
                if (output.stop_reason != "aborted" or self.closing
                        or engine in self.live([engine]) or request_id in self._aborted
                        or epoch != self._abort_epoch):
                    return output
            tried.append(engine)
            self.requests_moved += 1

    async def abort(self, request_id: str) -> None:
        if any(request_id in engine.requests for engine in self.engines):  # running: remember
            self._aborted.add(request_id)
        await asyncio.gather(*(engine.abort(request_id) for engine in self.live()))

    async def abort_all(self) -> None:
        self._abort_epoch += 1
        await asyncio.gather(*(engine.abort_all() for engine in self.live()))

    # ---- memory ---------------------------------------------------------------------------
    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.sleep(tags) for engine in self.live()))

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.wake_up(tags) for engine in self.live()))

    async def clear_kv_cache(self) -> None:
        await asyncio.gather(*(engine.clear_kv_cache() for engine in self.live()))

    def memory_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for engine in self.live():
            for key, value in engine.memory_bytes().items():
                total[key] = total.get(key, 0) + value
        return total

    # ---- weights --------------------------------------------------------------------------
    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        """Stage one stream into every live engine: it is copied once (a transport's buffers
        are reused as it advances), then each engine checks and stages the copy."""
        stream = [(name, item if isinstance(item, WeightPatch) else item.detach().clone())
                  for name, item in named_tensors]
        return [(engine, engine.stage_weights(iter(stream))) for engine in self.live()]

    async def commit_weights(self, staged: list[Any], version: int, partial: bool = False
                             ) -> float:
        """Commit every engine's staged update; the first refusal raises with nothing
        installed anywhere, a later one takes the replica out (its engines now differ). An
        engine lost since staging is skipped (it never serves again)."""
        stood_still, committed = 0.0, 0
        for engine, part in staged:
            if engine not in self.live([engine]):
                continue
            try:
                stood_still += await engine.commit_weights(part, version, partial)
            except Exception as error:
                if engine not in self.live([engine]):
                    continue
                if committed:
                    index = self.engines.index(engine)
                    self.failure = (f"{self.kind} replica failed: engine {index} refused "
                                    f"version {version} after another took it ({error}); the "
                                    "replica must be restarted")
                    raise ReplicaFailedError(self.failure) from error
                raise
            committed += 1
        return stood_still

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        await self.commit_weights(self.stage_weights(named_tensors), version, partial)

    def current_weight(self, name: str) -> torch.Tensor:
        return self._first_live().current_weight(name)

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The values at `index`, the same in every engine (a delta's check; engines that
        differ there are refused: a patch would leave them different)."""
        values = [engine.current_values(name, index) for engine in self.live()]
        if any(not torch.equal(values[0], other) for other in values[1:]):
            raise ValueError(f"current_values: the {self.kind} replica's engines hold "
                             f"different values of {name!r}; a full sync makes them equal")
        return values[0]

    def patches_in_place(self, name: str) -> bool:
        return self._first_live().patches_in_place(name)

    def synced_in_full(self) -> bool:
        return all(engine.synced_in_full() for engine in self.live())

    @property
    def weight_version(self) -> int:
        return self._first_live().weight_version

    def raise_if_failed(self) -> None:
        """ReplicaFailedError when engines differ in version or none is left to serve."""
        if self.failure is not None:
            raise ReplicaFailedError(self.failure)
        problem = self.serving_problem()
        if problem is not None:
            raise ReplicaFailedError(f"{self.kind} replica failed: {problem}; lost: "
                                     f"{self._lost_summary()}")

    def serving_problem(self) -> str | None:
        """Why the engines left cannot serve (None: they can): here, none is left."""
        return None if self.live() else "every engine stopped"

    def _first_live(self) -> NativeRollout:
        self.raise_if_failed()
        return self.live()[0]

    def _lost_summary(self) -> str:
        return "; ".join(f"engine {index}: {why}" for index, why in sorted(self.lost.items()))

    def stats(self) -> dict[str, Any]:
        """Every engine's counters summed (the earliest first_token_time)."""
        total: dict[str, Any] = {"replica_engines": len(self.engines),
                                 "replica_engines_lost": len(self.lost),
                                 "replica_requests_moved": self.requests_moved}
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
        self.closing = True
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))


def _stopped(engine: NativeRollout) -> str | None:
    """Why `engine` no longer serves (shut down, its tensor-parallel ranks failed), else None."""
    if engine.closed:
        return "shut down"
    try:
        engine.raise_if_failed()
    except ReplicaFailedError as error:
        return str(error)
    return None
