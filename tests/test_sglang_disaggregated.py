"""SGLang's prefill/decode replica (rollout/sglang_disaggregated.py; SGLang runs on CUDA only, so
its request path runs here against recording stand-ins of SGLangRollout): both engines get one
request at once with the same bootstrap room, the decode engine's output is the replica's, a
failed or aborted prefill aborts its decode, and each engine's ServerArgs."""

from __future__ import annotations

import asyncio
import collections

import pytest

from tandem.config.load import load_config
from tandem.config.schema import DisaggregationConfig
from tandem.rollout.registry import rollout_class
from tandem.rollout.sglang_disaggregated import (BOOTSTRAP_HOST, SGLangDisaggregatedRollout,
                                                 engine_args)
from tandem.types import GenerateRequest, TokenOutput

SAMPLING = {"temperature": 0, "max_tokens": 5, "logprobs": True}


ROOMS: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)  # KV sent to a room


class Engine:
    """Records each generate's request and bootstrap; `gate` holds a generate until set; a
    prefill returns one token and sends its room the KV, a decode waits for its room's KV (or
    an abort) and returns its tokens (or aborted when aborted)."""

    def __init__(self, name: str, prefill: bool = False) -> None:
        self.name, self.prefill, self.calls, self.running = name, prefill, [], set()
        self.gate: asyncio.Event | None = None
        self.aborted: list[str] = []
        self.fail: Exception | None = None
        self.version = 0

    async def generate(self, request, bootstrap=None):
        self.calls.append((request, bootstrap))
        self.running.add(request.request_id)
        room = ROOMS[bootstrap["bootstrap_room"]]
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.prefill and self.fail is None:
                room.set()
            elif not self.prefill:
                self.gate = room
                await room.wait()
        finally:
            self.running.discard(request.request_id)
        if self.fail is not None:
            raise self.fail
        if request.request_id in self.aborted:
            return TokenOutput([], [], "aborted", {"global_steps": self.version})
        count = 1 if self.prefill else request.sampling["max_tokens"]
        return TokenOutput(list(range(count)), [-0.25] * count, "length",
                           {"global_steps": self.version, "served_by": self.name})

    async def abort(self, request_id):
        self.aborted.append(request_id)
        if self.gate is not None and request_id in self.running:
            self.gate.set()  # an aborted decode stops waiting for its KV

    @property
    def weight_version(self):
        return self.version


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_prefill_and_decode_run_at_once_in_one_bootstrap_room():
    prefill, decode = Engine("p", prefill=True), Engine("d0")
    pd = SGLangDisaggregatedRollout(prefill, [decode], bootstrap_port=41234)
    prefill.gate = asyncio.Event()
    running = asyncio.ensure_future(pd.generate(GenerateRequest("s0", [5, 6, 7], SAMPLING)))
    # the decode engine waits for the KV while the prefill computes it
    await asyncio.wait_for(until(lambda: prefill.running and decode.running), 5)
    prefill.gate.set()
    output = await asyncio.wait_for(running, 5)
    assert output.token_ids == list(range(5)) and output.extra_fields["served_by"] == "d0"
    [(prefill_request, prefill_boot)] = prefill.calls
    [(decode_request, decode_boot)] = decode.calls
    assert prefill_request == decode_request  # the whole request to both (SGLang stops prefill)
    assert prefill_boot == decode_boot
    assert prefill_boot["bootstrap_host"] == BOOTSTRAP_HOST
    assert prefill_boot["bootstrap_port"] == 41234
    await pd.generate(GenerateRequest("s1", [8], SAMPLING))
    assert prefill.calls[1][1]["bootstrap_room"] != prefill_boot["bootstrap_room"]
    assert 0 <= prefill_boot["bootstrap_room"] < 2 ** 63


async def test_a_failed_or_aborted_prefill_aborts_its_decode():
    prefill, decode = Engine("p", prefill=True), Engine("d0")
    pd = SGLangDisaggregatedRollout(prefill, [decode], bootstrap_port=1)
    prefill.fail = ConnectionError("transfer backend down")
    with pytest.raises(ConnectionError, match="transfer backend down"):
        await asyncio.wait_for(pd.generate(GenerateRequest("r", [5], SAMPLING)), 5)
    assert decode.aborted == ["r"] and not decode.running

    prefill.fail = None
    prefill.aborted.append("a")  # the caller's abort reached the prefill engine first
    output = await asyncio.wait_for(pd.generate(GenerateRequest("a", [5], SAMPLING)), 5)
    assert output.stop_reason == "aborted" and output.token_ids == [] and output.log_probs == []
    assert decode.aborted == ["r", "a"] and not decode.running


def test_each_engine_gets_its_mode_backend_gpu_and_ports():
    pd = DisaggregationConfig(enabled=True, decode_replicas=2, kv_transfer="mooncake")
    prefill = engine_args(pd, "cuda:2", prefill=True, bootstrap_port=40000)
    decode = engine_args(pd, "cuda:3", prefill=False, bootstrap_port=40000)
    assert prefill["disaggregation_mode"] == "prefill" and decode["disaggregation_mode"] == "decode"
    assert prefill["disaggregation_transfer_backend"] == "mooncake"
    assert (prefill["base_gpu_id"], decode["base_gpu_id"]) == (2, 3)
    assert prefill["disaggregation_bootstrap_port"] == 40000
    assert "disaggregation_bootstrap_port" not in decode
    assert prefill["port"] != decode["port"]
    with pytest.raises(ValueError, match="SGLang's prefill/decode takes one of"):
        engine_args(DisaggregationConfig(enabled=True, kv_transfer="shm"), "cuda:0", True, 1)


def test_the_registry_routes_an_sglang_pd_config_and_cpu_is_refused():
    import importlib.util

    config = load_config(overrides=["rollout.name=sglang", "model.device=cuda",
                                    "rollout.disaggregation.enabled=true", "rollout.nnodes=1",
                                    "rollout.n_gpus_per_node=2",
                                    "rollout.disaggregation.kv_transfer=nixl"])
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match="needs the 'sglang' package"):
            rollout_class(config.rollout)
    else:
        assert rollout_class(config.rollout) is SGLangDisaggregatedRollout
    with pytest.raises(RuntimeError, match="SGLang runs on CUDA only"):
        SGLangDisaggregatedRollout.create("unused", config.rollout, device="cpu")
