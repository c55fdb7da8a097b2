"""vLLM serving the actor's adapter through its LoRA API (`enable_lora`, add_lora and a
LoRARequest on every request): opt-in, `make test-vllm`. After an adapter-only update its
greedy tokens equal the native engine's with the same adapter (which equals HF with the merged
weights, tests/test_engine_lora.py); a bad adapter leaves the previous one serving."""

import asyncio
import dataclasses

import pytest
import torch

from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.rollout.registry import unavailable_reason
from tandem.types import GenerateRequest

from conformance.conftest import CONFIG, SPEC
from test_engine_lora import GREEDY, PROMPTS, lora_actor

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason("vllm") is not None,
                                 reason=str(unavailable_reason("vllm")))]


async def greedy(rollout, prefix):
    return [(await rollout.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY))).token_ids
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_vllm_serves_the_adapter_like_the_native_engine(tensor_parallel):
    """With tensor_parallel 2 each of vLLM's two workers serves its shard of the adapter."""
    from tandem.rollout.vllm import VLLMRollout

    path = build_tiny_model(SPEC)
    first, second = lora_actor(path, seed=1), lora_actor(path, seed=2)

    async def run():
        vllm = VLLMRollout.create(path, dataclasses.replace(
            CONFIG, lora_rank=4, tensor_model_parallel_size=tensor_parallel), "float32", "cpu")
        native = NativeRollout.create(path, CONFIG)
        try:
            base = await greedy(vllm, "base")
            results = []
            for version, actor in ((1, first), (2, second)):
                await vllm.update_weights(actor.export_weights(), version)
                await native.update_weights(actor.export_weights(), version)
                results.append((await greedy(vllm, f"v{version}"), await greedy(native, f"n{version}")))
            bad = [(n, torch.full_like(t, float("nan")) if n.endswith("lora_B.weight") else t)
                   for n, t in first.export_weights()]
            with pytest.raises(ValueError, match="NaN"):
                await vllm.update_weights(bad, 3)
            assert vllm.weight_version == 2
            results.append((await greedy(vllm, "after-bad"), results[-1][1]))
            return base, results
        finally:
            await vllm.shutdown()
            await native.shutdown()

    base, results = asyncio.run(run())
    for served, expected in results:
        assert served == expected
    assert results[0][0] != base
