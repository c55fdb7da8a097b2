"""A data-parallel replica (rollout/data_parallel.py: rollout.data_parallel_size engine groups
behind one address) against a plain engine on a tiny fp32 model: greedy tokens, requests spread
over the groups and a session kept on its group, a weight update reaching every group (all or
nothing), abort, and DP x TP (two groups of two ranks, four processes)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from test_engine_tensor_parallel import perturbed_model
from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.base import ReplicaFailedError
from tandem.rollout.data_parallel import DataParallelRollout
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest

PLAIN = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=4)
DP2 = dataclasses.replace(PLAIN, data_parallel_size=2)
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 25))] for _ in range(count)]


async def greedy(engine, batch: list[list[int]], prefix: str) -> list[list[int]]:
    outputs = await asyncio.gather(*(engine.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY))
                                     for i, p in enumerate(batch)))
    return [output.token_ids for output in outputs]


async def test_requests_spread_over_the_groups_and_a_session_stays_on_its_own(model_path):
    batch = prompts(16, 700, seed=1)
    plain = NativeRollout.create(model_path, PLAIN)
    dp = DataParallelRollout.create(model_path, DP2)
    try:
        assert await greedy(dp, batch, "r") == await greedy(plain, batch, "r")
        served = [engine.counters["generated_tokens"] for engine in dp.engines]
        assert served[0] > 0 and served[1] > 0 and sum(served) == 16 * 10
        # the next turn of session r3 runs where its first did: its prompt is in that cache
        home = dp.route("r3", dp.engines)
        cached = home.scheduler.prompt_tokens_cached
        await dp.generate(GenerateRequest("r3", batch[3] + [7] * 9, GREEDY))
        assert home.scheduler.prompt_tokens_cached > cached
        stats = dp.stats()
        assert stats["replica_engines"] == 2 and stats["generated_tokens"] == 16 * 10 + 10
    finally:
        await plain.shutdown()
        await dp.shutdown()


async def test_a_weight_update_reaches_every_group_or_takes_the_replica_out(model_path,
                                                                          tmp_path):
    state = perturbed_model(model_path, tmp_path, seed=2)  # saved in tmp_path
    batch = prompts(8, 700, seed=2)
    dp = DataParallelRollout.create(model_path, DP2)
    fresh = NativeRollout.create(tmp_path, PLAIN)
    try:
        bad = dict(state)
        bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
        with pytest.raises(ValueError, match="NaN"):  # refused at staging: nothing installed
            await dp.update_weights(bad.items(), version=1)
        assert [engine.weight_version for engine in dp.engines] == [0, 0]
        await dp.update_weights(state.items(), version=1)
        assert [engine.weight_version for engine in dp.engines] == [1, 1] == [dp.weight_version] * 2
        assert await greedy(dp, batch, "u") == await greedy(fresh, batch, "u")

        async def refuse(*args, **kwargs):
            raise RuntimeError("the weights were put to sleep")

        dp.engines[1].commit_weights = refuse  # the second group refuses after the first took it
        with pytest.raises(ReplicaFailedError, match="engine 1 refused version 2"):
            await dp.update_weights(state.items(), version=2)
        with pytest.raises(ReplicaFailedError):  # out of the fleet: the probe and generate say so
            dp.weight_version
        with pytest.raises(ReplicaFailedError):
            await dp.generate(GenerateRequest("x", [5, 6], GREEDY))
    finally:
        await dp.shutdown()
        await fresh.shutdown()


async def test_abort_reaches_every_group(model_path):
    dp = DataParallelRollout.create(model_path, DP2)
    try:
        long = {**GREEDY, "max_tokens": 300}
        running = [asyncio.ensure_future(dp.generate(GenerateRequest(f"l{i}", [5, 6, i], long)))
                   for i in range(4)]
        while sum(engine.counters["generated_tokens"] for engine in dp.engines) < 8:
            await asyncio.sleep(0.001)
        await dp.abort_all()
        outputs = await asyncio.gather(*running)
        assert all(output.stop_reason == "aborted" for output in outputs)
        assert all(engine.requests == {} for engine in dp.engines)
    finally:
        await dp.shutdown()


async def test_a_group_that_stops_mid_generation_hands_its_requests_to_the_other(model_path):
    """An engine group shut down under 4 running requests: they run again on the other group,
    each output a plain engine's (none aborted); the replica fails once no group is left."""
    dp = DataParallelRollout.create(model_path, DP2)
    plain = NativeRollout.create(model_path, PLAIN)
    try:
        long = {**GREEDY, "max_tokens": 40}
        requests = [GenerateRequest(f"k{i}", [5, 6, 9 + i], long) for i in range(4)]
        running = [asyncio.ensure_future(dp.generate(r)) for r in requests]
        while sum(engine.counters["generated_tokens"] for engine in dp.engines) < 8:
            await asyncio.sleep(0.001)
        victim = next(engine for engine in dp.engines if engine.requests)
        await victim.shutdown()
        outputs = await asyncio.gather(*running)
        assert [o.token_ids for o in outputs] == [(await plain.generate(r)).token_ids for r in requests]
        assert all(o.stop_reason == "length" for o in outputs)
        assert list(dp.lost) == [dp.engines.index(victim)] and dp.requests_moved >= 1
        await dp.engines[1 - dp.engines.index(victim)].shutdown()
        with pytest.raises(ReplicaFailedError, match="every engine stopped"):
            await dp.generate(requests[0])
    finally:
        await dp.shutdown()
        await plain.shutdown()


async def test_a_request_aborted_as_its_engine_stops_stays_aborted(model_path):
    """The caller's abort wins over the failover: the request is not run again elsewhere."""
    dp = DataParallelRollout.create(model_path, DP2)
    try:
        running = asyncio.ensure_future(dp.generate(GenerateRequest(
            "a", [5, 6, 7], {**GREEDY, "max_tokens": 300})))
        while sum(engine.counters["generated_tokens"] for engine in dp.engines) < 4:
            await asyncio.sleep(0.001)
        victim = next(engine for engine in dp.engines if engine.requests)
        await dp.abort("a")
        await victim.shutdown()
        output = await running
        assert output.stop_reason == "aborted" and 1 <= len(output.token_ids) < 300
        assert dp.requests_moved == 0 and dp._aborted == set()
    finally:
        await dp.shutdown()


async def test_two_groups_of_two_tensor_parallel_ranks_serve_like_one_engine(model_path):
    batch = prompts(8, 700, seed=3)
    plain = NativeRollout.create(model_path, PLAIN)
    wide = DataParallelRollout.create(model_path, dataclasses.replace(
        DP2, tensor_model_parallel_size=2))
    try:
        assert [engine.ranks.size for engine in wide.engines] == [2, 2]
        assert await greedy(wide, batch, "w") == await greedy(plain, batch, "w")
        assert all(engine.counters["generated_tokens"] > 0 for engine in wide.engines)
    finally:
        await plain.shutdown()
        await wide.shutdown()
