"""The serving stack over the real native engine on a local Ray cluster (tiny Qwen2, fp32, CPU).

The partial-rollout acceptance test: abort while 32 requests are mid-generation, update the
weights, resume; every request completes its budget and no token is generated twice.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.server import RolloutServer

from float_bounds import assert_within, token_logprob_bounds
from test_serving_scripted import load_weights
from tandem.types import GenerateRequest

CONFIG = RolloutConfig(kv_cache_memory_bytes=16 << 20, block_size=16)


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def manager(ray_cluster, model_path):
    options = ServerOptions(model_path=str(model_path), device_bundle={"CPU": 0.01},
                            start_timeout_s=180)
    manager = asyncio.run(ServerManager.create(CONFIG, options, "standalone", total_devices=2))
    yield manager
    asyncio.run(manager.shutdown())


async def generated_tokens(manager: ServerManager) -> int:
    return sum(s["backend"]["generated_tokens"] for s in (await manager.stats()).values())


async def test_greedy_through_the_stack_equals_the_engine_called_directly(manager,
                                                                          model_path) -> None:
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    direct = NativeRollout.create(model_path, CONFIG)
    expected = [await direct.generate(GenerateRequest(f"d{i}", p, params)) for i, p in enumerate(prompts)]
    await direct.shutdown()
    client = manager.client()
    served = await asyncio.gather(*(client.generate(GenerateRequest(f"s{i}", p, params))
                                    for i, p in enumerate(prompts)))
    assert [o.token_ids for o in served] == [o.token_ids for o in expected]
    # batched differently, so rounded differently: each within the float32 bound of the exact
    # log-probs (tests/float_bounds.py), so within twice it of each other
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for prompt, got, want in zip(prompts, served, expected):
        _, bound = token_logprob_bounds(hf, prompt, want.token_ids)
        assert_within(torch.tensor(got.log_probs), torch.tensor(want.log_probs), 2 * bound,
                      "served vs direct log-probs")


async def test_partial_rollout_abort_update_weights_resume(manager, model_path) -> None:
    budget = 160
    client = manager.resumable_client()
    start = await generated_tokens(manager)
    tasks = [asyncio.ensure_future(client.generate(
        GenerateRequest(f"traj{i}", [3 + i, 4, 5 + i % 7], {"max_tokens": budget, "ignore_eos": True})))
        for i in range(32)]
    for _ in range(1000):  # every request has some tokens of version 0
        if await generated_tokens(manager) - start >= 32 * 4:
            break
        await asyncio.sleep(0.01)
    assert sum(sum(n) for n in (await manager.control("abort_all_requests")).results.values()) == 32
    new_weights = {name: tensor + 0.01 * torch.randn_like(tensor)
                   for name, tensor in load_file(model_path / "model.safetensors").items()}
    await load_weights(manager, list(new_weights.items()), 1)
    assert (await manager.status()).in_flight() == {"replica-0": 16, "replica-1": 16}
    await manager.control("resume_generation")
    outputs = await asyncio.gather(*tasks)

    assert all(o.stop_reason == "length" and len(o.token_ids) == budget for o in outputs)
    assert all(len(o.log_probs) == len(o.token_ids) for o in outputs)
    assert all(math.isfinite(lp) and lp <= 0 for o in outputs for lp in o.log_probs)
    assert all(o.extra_fields["resumes"] >= 1 for o in outputs)
    assert all(o.extra_fields["min_global_steps"] == 0 < o.extra_fields["max_global_steps"] == 1
               for o in outputs)
    # per token: a run of version 0, then version 1 on the rest of the budget
    assert all([v for v, _ in o.version_runs] == [0, 1] for o in outputs)
    # The engines sampled exactly the tokens returned: none was generated twice.
    assert await generated_tokens(manager) - start == 32 * budget
    assert sum((await manager.status()).in_flight().values()) == 0


async def test_hybrid_in_process_sync_cycle(model_path) -> None:
    """The sync trainer's cycle with the engine in the driver: generate, sleep, wake, update."""
    host = RolloutServer("driver")
    manager = await ServerManager.create(CONFIG, ServerOptions(str(model_path)), "hybrid",
                                         hosts=[host])
    client = manager.resumable_client()
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    before = await client.generate(GenerateRequest("a", [5, 6, 7], params))
    await manager.control("sleep", ["weights", "kv_cache"])
    assert host.backend.memory_bytes()["kv_cache"] == 0
    await manager.control("wake_up", ["weights", "kv_cache"])
    weights = load_file(model_path / "model.safetensors")
    await load_weights(manager, [(name, tensor * 1.5) for name, tensor in weights.items()], 3)
    after = await client.generate(GenerateRequest("a", [5, 6, 7], params))
    assert after.global_steps == after.extra_fields["min_global_steps"] == 3
    # the new weights are in use (greedy tokens of a random tiny model may not move; log-probs do)
    assert after.log_probs != before.log_probs
    await load_weights(manager, list(weights.items()), 4)
    again = await client.generate(GenerateRequest("b", [5, 6, 7], params))
    assert again.token_ids == before.token_ids and again.global_steps == 4
    assert again.log_probs == before.log_probs
    await manager.shutdown()


async def test_a_request_with_an_adapter_the_engine_lacks_is_refused_by_the_server(manager):
    client = manager.client()
    request = GenerateRequest("lora", [5, 6, 7], {"max_tokens": 2}, adapter="math-lora")
    with pytest.raises(Exception, match=r"GenerateRequest.adapter='math-lora'"):
        await client.generate(request)
    assert len((await client.generate(request.replace(adapter=None))).token_ids) == 2
