"""Double-buffered weight slots in a tensor-parallel replica (TP=2: rank 0 in this process's
server, rank 1 a worker process): a sender process writes every rank's slices into the inactive
slot while the replica generates, then all ranks flip together between two steps."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.server import RolloutServer
from tandem.types import GenerateRequest
from test_engine_tensor_parallel import SPECS, assert_ranks_hold
from test_weight_sync_slots import (ANSWER_S, PROMPTS, actor_state, fresh_engine_tokens, generated,
                                    greedy, plan_for)
from weight_sync_procs import Worker, run_sender

TP2 = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16, tensor_model_parallel_size=2)
LONG = {"temperature": 0.0, "max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module", params=list(SPECS))
def model_path(request):
    return build_tiny_model(SPECS[request.param])


@pytest.fixture
def sender():
    worker = Worker()
    yield worker
    worker.close()


async def sync_into_slot(sender: Worker, server: RolloutServer, state, version: int) -> dict:
    plan = await plan_for(sender, server, version)
    sender.submit(run_sender, "db", plan, state)
    timings = await server.receive_weights(plan, 1, {})
    assert not (await asyncio.to_thread(sender.result, ANSWER_S))["error"]
    return timings


@pytest.mark.parametrize("in_flight_kv", ["recompute", "keep"])
async def test_every_rank_flips_to_its_slices_and_requests_carry_both_versions(
        model_path, sender, tmp_path, in_flight_kv):
    server = RolloutServer("tp-slots")
    await server.start(NativeRollout, model_path, dataclasses.replace(TP2, in_flight_kv=in_flight_kv))
    engine = server.backend
    try:
        running = [asyncio.create_task(server.generate(GenerateRequest(f"long{i}", prompt, LONG)))
                   for i, prompt in enumerate(PROMPTS)]
        while generated(server) < 8:
            await asyncio.sleep(0.005)
        before = server.stats()["backend"]
        state = actor_state(model_path, 1)
        timings = await sync_into_slot(sender, server, state, 1)
        assert timings["version"] == 1 and engine.weight_slot_active == 1
        flipped_at = generated(server)
        while generated(server) < flipped_at + 4:
            await asyncio.sleep(0.005)
        after = server.stats()["backend"]
        await server.abort_all_requests()
        await server.resume_generation()
        for output in await asyncio.gather(*running):
            assert [version for version, _ in output.version_runs] == [0, 1], output.version_runs
        preempted = after["preemptions"] - before["preemptions"]
        assert preempted == (0 if in_flight_kv == "keep" else len(PROMPTS))
        assert_ranks_hold(engine, state)  # byte-equal to each rank's slice of the sent state
        assert await greedy(server, "after") == await fresh_engine_tokens(model_path, state,
                                                                          tmp_path / "one")
        # the next version lands in the other slot, slot 0, on every rank
        state = actor_state(model_path, 2)
        assert (await sync_into_slot(sender, server, state, 2))["version"] == 2
        assert engine.weight_slot_active == 0
        assert_ranks_hold(engine, state)
        assert await greedy(server, "two") == await fresh_engine_tokens(model_path, state,
                                                                        tmp_path / "two")
    finally:
        await server.shutdown()
