"""Prefix cache: hash-chained full blocks shared between requests, LRU eviction, counters."""

from __future__ import annotations

import asyncio

import pytest

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.engine.block_manager import BlockManager
from tandem.rollout.engine.sequence import Sequence
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, SamplingParams

from float_bounds import assert_within, token_logprob_bounds

BLOCK = 8


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def make(model_path, **overrides) -> NativeRollout:
    config = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=BLOCK, **overrides)
    return NativeRollout.create(model_path, config)


GREEDY = {"temperature": 0, "max_tokens": 10}


async def test_second_request_computes_only_its_suffix(model_path):
    rollout = make(model_path)
    prefix = list(range(10, 10 + 3 * BLOCK))  # three full blocks
    first = await rollout.generate(GenerateRequest("a", prefix + [50, 51, 52], GREEDY))
    before = rollout.stats()
    second = await rollout.generate(GenerateRequest("b", prefix + [60, 61, 62, 63, 64], GREEDY))
    after = rollout.stats()
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == 3 * BLOCK
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 5

    plain = make(model_path, enable_prefix_caching=False)
    assert (await plain.generate(GenerateRequest("a", prefix + [50, 51, 52], GREEDY))).token_ids == first.token_ids
    assert (await plain.generate(GenerateRequest("b", prefix + [60, 61, 62, 63, 64], GREEDY))).token_ids == \
        second.token_ids
    assert plain.stats()["prompt_tokens_cached"] == 0


async def test_n_samples_of_one_prompt_share_it_in_the_same_step(model_path):
    rollout = make(model_path)
    prompt = list(range(20, 20 + 4 * BLOCK + 3))
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"s{i}", prompt, {"temperature": 1.0,
                                                                     "max_tokens": 6}))
                                  for i in range(8)))
    stats = rollout.stats()
    assert stats["prompt_tokens_computed"] == len(prompt) + 7 * 3  # 7 others compute only the tail
    assert stats["prompt_tokens_cached"] == 7 * 4 * BLOCK
    assert all(len(out.token_ids) == 6 for out in outs)


async def test_next_turn_reuses_the_conversation(model_path):
    rollout = make(model_path)
    turn1 = list(range(30, 30 + 2 * BLOCK + 2))
    out = await rollout.generate(GenerateRequest("t1", turn1, {"temperature": 0, "max_tokens": 2 * BLOCK}))
    turn2 = turn1 + out.token_ids + [7, 8, 9]
    before = rollout.stats()["prompt_tokens_cached"]
    await rollout.generate(GenerateRequest("t2", turn2, GREEDY))
    cached = rollout.stats()["prompt_tokens_cached"] - before
    # turn 1 left KV for its first 2 * BLOCK + 2 + 2 * BLOCK - 1 tokens: four full blocks
    assert cached == 4 * BLOCK


async def test_clear_kv_cache_drops_every_entry(model_path):
    rollout = make(model_path)
    prompt = list(range(10, 10 + 3 * BLOCK + 1))
    await rollout.generate(GenerateRequest("a", prompt, GREEDY))
    assert rollout.stats()["cached_blocks"] >= 3
    await rollout.clear_kv_cache()
    assert rollout.stats()["cached_blocks"] == 0
    before = rollout.stats()["prompt_tokens_cached"]
    await rollout.generate(GenerateRequest("b", prompt, GREEDY))
    assert rollout.stats()["prompt_tokens_cached"] == before


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("x", list(tokens), SamplingParams(), frozenset(), 10_000)


def test_lru_evicts_the_oldest_unreferenced_block():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = _seq([1, 2, 3, 4, 5])  # two full blocks + one token
    manager.allocate(first, 5)
    manager.register_full_blocks(first, 5)
    manager.release(first)
    assert manager.num_cached_blocks == 2 and manager.num_free_blocks == 4
    # the chain's tail block is evicted before its head
    filler = _seq([9, 9, 9, 9, 9, 9])
    assert manager.allocate(filler, 6)  # 2 clean blocks + evicts 1 cached (the tail [3, 4])
    assert manager.num_cached_blocks == 1
    again = _seq([1, 2, 3, 4, 5])
    assert [block for block, _ in manager.find_prefix(again)] == [first_block(manager, [1, 2])]
    assert not manager.allocate(_seq([7] * 4), 4)  # only one evictable block left


def first_block(manager: BlockManager, tokens: list[int]) -> int:
    return next(b for b, t in enumerate(manager.block_tokens) if t == tuple(tokens))


def test_equal_blocks_of_different_prefixes_are_not_confused():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = _seq([1, 2, 5, 6, 0])
    manager.allocate(a, 5)
    manager.register_full_blocks(a, 5)
    b = _seq([3, 4, 5, 6, 0])  # same second block, different first block
    assert manager.find_prefix(b) == []


async def test_cascade_attention_over_shared_prefixes_matches_plain_attention(model_path,
                                                                               monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    import tandem.rollout.engine.model_runner as model_runner

    # cascade attention is the torch path's decode attention (CUDA, or CPU without the fused
    # kernels, whose decode kernel reads shared blocks in place instead)
    monkeypatch.setattr(model_runner.cpu_kernels, "load", lambda: None)
    system = list(range(40, 40 + BLOCK + 3))  # shared by every prompt, not block aligned
    prompts = [system + [100 + p] * (2 * BLOCK + p) for p in range(3)]
    cascades = []
    build = model_runner.build_cascade_group
    monkeypatch.setattr(model_runner, "build_cascade_group",
                        lambda *args: cascades.append(args[3]) or build(*args))

    async def run() -> list:
        rollout = make(model_path)

        async def one(prompt_index: int, sample: int):
            await asyncio.sleep(0.003 * sample)
            return await rollout.generate(GenerateRequest(f"{prompt_index}-{sample}", prompts[prompt_index],
                                          {"temperature": 1.0, "seed": 10 * prompt_index + sample,
                                           "max_tokens": 6 + 4 * sample, "ignore_eos": True}))

        return await asyncio.gather(*(one(p, s) for p in range(3) for s in range(4)))

    with_cascade = await run()
    assert cascades and any(len(families) == 3 for families in cascades)
    monkeypatch.setattr(model_runner, "CASCADE_MIN_SAVING", 2.0)  # never worth it: plain path
    cascades.clear()
    plain = await run()
    assert not cascades
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for index, (a, b) in enumerate(zip(with_cascade, plain)):
        assert a.token_ids == b.token_ids
        # each path is within the float32 bound of the exact log-probs, so within twice it of
        # the other
        exact, bound = token_logprob_bounds(hf, prompts[index // 4], a.token_ids)
        assert_within(torch.tensor(a.log_probs), exact, bound, "cascade attention")
        assert_within(torch.tensor(a.log_probs), torch.tensor(b.log_probs), 2 * bound,
                      "cascade vs plain attention")
