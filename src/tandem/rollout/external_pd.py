"""A prefill/decode replica of an external engine (vLLM: vllm_disaggregated.py; SGLang:
sglang_disaggregated.py): one prefill and `decode_replicas` decode engines of that backend in the
replica's server process, where the engine moves the KV itself (its KV connector or its
disaggregation mode); this module is what they share.

Decode engines are chosen sticky by request_id (a session's earlier turns are in that engine's
prefix cache), else by the fewest requests running. Control verbs and weight updates reach every
engine, in turn; an update refused after the first engine took it takes the replica out (two
versions must not serve together). A request whose prefill and decode ran on different weight
versions (an update between them) runs again, so no KV computed with old weights is decoded with
new ones (invariant 3). An abort that lands while the prefill runs ends the request (aborted, no
tokens). Each backend says how one request crosses (`_handoff`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from tandem.config.schema import DisaggregationConfig
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, ReplicaFailedError
from tandem.rollout.engine_group import engine_devices
from tandem.types import GenerateRequest, TokenOutput

MAX_STICKY = 100_000  # request ids remembered for routing (LRU)
VERSION_RETRIES = 3  # runs of a request whose prefill and decode saw different weight versions


class ExternalPDRollout(BaseRollout):
    """One prefill and N decode engines of one external backend (each a BaseRollout with a
    `running` set of request ids) serving as one replica."""

    backend = ""  # named in errors
    cpu_refusal = ""  # why the backend's prefill/decode does not start on CPU

    def __init__(self, prefill: Any, decodes: list[Any]) -> None:
        if not decodes:
            raise ValueError("a prefill/decode replica needs at least one decode engine")
        self.prefill_engine, self.decode_engines = prefill, list(decodes)
        self.engines = [prefill, *decodes]
        self.failure: str | None = None
        self._sticky: OrderedDict[str, int] = OrderedDict()  # request id -> decode index
        self._aborted: set[str] = set()  # ids aborted while their prefill or handoff ran
        self._abort_epoch = 0  # abort_all calls so far

    @classmethod
    def start_engines(cls, config: Any, device: str, rendezvous: Any,
                      start: Callable[[int, str, Any], Any]) -> list[Any]:
        """The 1 + decode_replicas engines of `config` (prefill first), engine k started by
        start(k, its GPU, `config` without disaggregation); those started are shut down when
        one fails. CUDA and one node only (the refusals name `cls.backend`)."""
        if rendezvous is not None:
            raise ValueError("a prefill/decode replica fits one node; it takes no rendezvous")
        if not device.startswith("cuda"):
            raise RuntimeError(f"rollout.disaggregation with the {cls.backend} backend: "
                               f"{cls.cpu_refusal}")
        plain = dataclasses.replace(config, disaggregation=DisaggregationConfig())
        count = 1 + config.disaggregation.decode_replicas
        engines: list[Any] = []
        try:
            for index, engine_device in enumerate(engine_devices(device, [1] * count)):
                engines.append(start(index, engine_device, plain))
        except BaseException:
            for engine in engines:
                engine.engine.shutdown()
            raise
        return engines

    def _decode_for(self, request_id: str) -> Any:
        index = self._sticky.get(request_id)
        if index is None:
            loads = [len(engine.running) for engine in self.decode_engines]
            index = loads.index(min(loads))
        self._sticky[request_id] = index
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)
        return self.decode_engines[index]

    async def _handoff(self, request: GenerateRequest, decode: Any, epoch: int
                       ) -> tuple[TokenOutput, TokenOutput | None]:
        """Run `request` across the prefill engine and `decode`: (the prefill's output, the
        decode's, or None when it was aborted before its decode began: the prefill came back
        aborted, or the caller aborted it since `epoch`, `aborted_meanwhile`)."""
        raise NotImplementedError

    def aborted_meanwhile(self, request_id: str, epoch: int) -> bool:
        """Whether the caller aborted `request_id` (or everything) since `epoch`."""
        return request_id in self._aborted or epoch != self._abort_epoch

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """The request across prefill and decode (`_handoff`) on the session's decode engine
        (or the least loaded one); again when an update came between the two."""
        request_id, epoch = request.request_id, self._abort_epoch
        try:
            for _ in range(VERSION_RETRIES):
                self.raise_if_failed()
                prefilled, output = await self._handoff(request, self._decode_for(request_id),
                                                        epoch)
                if output is None:
                    return TokenOutput([], [] if request.sampling.get("logprobs") else None,
                                       "aborted", {"global_steps": prefilled.extra_fields.get(
                                           "global_steps", self.prefill_engine.weight_version)})
                if output.extra_fields.get("global_steps") == prefilled.extra_fields.get(
                        "global_steps") or output.stop_reason == "aborted":
                    return output
            raise RuntimeError(f"request {request_id!r}: weights changed between its prefill and "
                               f"its decode {VERSION_RETRIES} times in a row")
        finally:
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if any(request_id in engine.running for engine in self.engines):  # running: remember
            self._aborted.add(request_id)
        await asyncio.gather(*(engine.abort(request_id) for engine in self.engines))

    async def abort_all(self) -> None:
        self._abort_epoch += 1
        await asyncio.gather(*(engine.abort_all() for engine in self.engines))

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.sleep(tags) for engine in self.engines))

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = list(tags)
        await asyncio.gather(*(engine.wake_up(tags) for engine in self.engines))

    async def clear_kv_cache(self) -> None:
        await asyncio.gather(*(engine.clear_kv_cache() for engine in self.engines))

    def synced_in_full(self) -> bool:
        return all(engine.synced_in_full() for engine in self.engines)

    def memory_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for engine in self.engines:
            for key, value in engine.memory_bytes().items():
                total[key] = total.get(key, 0) + value
        return total

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        """The same tensors into every engine in turn (copied once, since a transport reuses
        its buffers); a failure after the first engine took them takes the replica out. A
        request caught between two engines' versions runs again (generate)."""
        stream = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        for index, engine in enumerate(self.engines):
            try:
                await engine.update_weights(iter(stream), version, partial)
            except Exception as error:
                if index:
                    self.failure = (f"{self.backend} prefill/decode replica failed: engine "
                                    f"{index} refused version {version} after engine 0 took it "
                                    f"({error})")
                    raise ReplicaFailedError(self.failure) from error
                raise

    @property
    def weight_version(self) -> int:
        self.raise_if_failed()
        return self.prefill_engine.weight_version

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ReplicaFailedError(self.failure)

    def stats(self) -> dict[str, Any]:
        """Every engine's counters summed."""
        total: dict[str, Any] = {"replica_engines": len(self.engines)}
        for engine in self.engines:
            for key, value in engine.stats().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        return total

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))
