"""A prefill/decode (PD) replica of the native engine (rollout.disaggregation.enabled): one prefill
engine and `decode_replicas` decode engines behind the replica's one address (docs/engine.md,
"Prefill/decode disaggregation").

A request is prefilled (prompt KV and first token; the prefill engine's prefix cache means a
session's next turn computes only its new tokens), then handed to a decode engine: the session's
last one (sticky by request_id, so its prefix cache holds the earlier turns and only new blocks
move), else the least loaded. The blocks move through a KV transfer (engine/kv_transfer.py).

The engines run in this process, each on its own device where the node has enough (CUDA), else
sharing one; their steps take turns on the server's event loop, so on CPU prefill and decode do
not overlap (a PD replica is for GPUs; on CPU it is correct, not faster). Control verbs reach
every engine; a weight update is staged into each and committed into all, and the version is
one (a commit that fails after another engine committed takes the replica out: ReplicaFailed).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import torch

from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, ReplicaFailedError
from tandem.rollout.engine.kv_transfer import InProcessTransfer
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, TokenOutput, WeightPatch

MAX_STICKY = 100_000  # request ids remembered for decode routing (LRU)


def engine_devices(device: str, count: int) -> list[str]:
    """One device per engine: consecutive CUDA devices from `device`'s when enough are visible,
    else all on `device` (CPU, or a test layout on one GPU)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return [device] * count
    first = torch.device(device).index or 0
    if first + count > torch.cuda.device_count():
        return [device] * count
    return [f"cuda:{first + index}" for index in range(count)]


class DisaggregatedRollout(BaseRollout):
    """One prefill engine and N decode engines (native, TP 1) serving as one replica."""

    capabilities = NativeRollout.capabilities

    def __init__(self, prefill: NativeRollout, decodes: list[NativeRollout],
                 transfer: Any | None = None) -> None:
        if not decodes:
            raise ValueError("a prefill/decode replica needs at least one decode engine")
        self.prefill_engine, self.decode_engines = prefill, list(decodes)
        self.engines = [prefill, *decodes]
        self.transfer = transfer or InProcessTransfer()
        self._sticky: OrderedDict[str, int] = OrderedDict()  # request id -> decode engine
        self._sessions = [0] * len(self.decode_engines)  # request ids each was given
        self.failure: str | None = None

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu", rendezvous: Any = None) -> "DisaggregatedRollout":
        """The engines of `config.disaggregation` (each a plain native engine of `config`)."""
        if rendezvous is not None:
            raise ValueError("a prefill/decode replica fits one node; it takes no rendezvous")
        plain = dataclasses.replace(config, disaggregation=DisaggregationConfig())
        count = 1 + config.disaggregation.decode_replicas
        engines: list[NativeRollout] = []
        try:
            for engine_device in engine_devices(device, count):
                engines.append(NativeRollout.create(model_path, plain, dtype, engine_device))
        except BaseException:
            for engine in engines:
                if engine.ranks is not None:
                    engine.ranks.stop(gracefully=False)
            raise
        return cls(engines[0], engines[1:])

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Prefill, then decode on the session's decode engine (or the least loaded one)."""
        self.raise_if_failed()
        prefilled = await self.prefill_engine.prefill(request)
        if prefilled.finished:
            return prefilled.output
        decode = self._decode_for(request.request_id)
        try:
            return await decode.generate_prefilled(request, prefilled, self.prefill_engine,
                                                   self.transfer)
        finally:  # the handoff released it already, unless it failed before
            self.prefill_engine.release_prefilled(request.request_id)

    def _decode_for(self, request_id: str) -> NativeRollout:
        index = self._sticky.get(request_id)
        if index is None:  # the fewest in flight, then the fewest sessions so far
            loads = [(len(engine.requests), sessions)
                     for engine, sessions in zip(self.decode_engines, self._sessions)]
            index = loads.index(min(loads))
            self._sessions[index] += 1
        self._sticky[request_id] = index
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)
        return self.decode_engines[index]

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
                    self.failure = (f"prefill/decode replica failed: engine {index} refused "
                                    f"version {version} after engine 0 took it ({error}); the "
                                    "replica must be restarted")
                    raise ReplicaFailedError(self.failure) from error
                raise
        return stood_still

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        await self.commit_weights(self.stage_weights(named_tensors), version, partial)

    def current_weight(self, name: str) -> torch.Tensor:
        return self.prefill_engine.current_weight(name)

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The values at `index`, the same in every engine (a delta's check; engines that
        differ there are refused: a patch would leave them different)."""
        values = [engine.current_values(name, index) for engine in self.engines]
        if any(not torch.equal(values[0], other) for other in values[1:]):
            raise ValueError(f"current_values: the prefill/decode replica's engines hold "
                             f"different values of {name!r}; a full sync makes them equal")
        return values[0]

    def patches_in_place(self, name: str) -> bool:
        return self.prefill_engine.patches_in_place(name)

    @property
    def weight_version(self) -> int:
        self.raise_if_failed()
        return self.prefill_engine.weight_version

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ReplicaFailedError(self.failure)
        for engine in self.engines:
            engine.raise_if_failed()

    def stats(self) -> dict[str, Any]:
        """Every engine's counters summed, plus the handoffs' blocks and bytes."""
        total: dict[str, Any] = {"disaggregated_engines": len(self.engines),
                                 "kv_transfer_blocks": self.transfer.blocks_moved,
                                 "kv_transfer_bytes": self.transfer.bytes_moved}
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
