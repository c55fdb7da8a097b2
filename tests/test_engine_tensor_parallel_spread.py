"""A tensor-parallel native replica spread over nodes: rank 0's node opens the rendezvous and
starts its own ranks, every other node's server (a rank host) starts the rest, which meet rank 0
there and then take every step from it. Here the "nodes" share this host (the two-host run in
tests/e2e/test_e2e_tensor_parallel_hosts.py puts them in separate network namespaces)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.base import ReplicaFailedError
from tandem.rollout.engine.rank_processes import spawn_workers
from tandem.rollout.engine.rank_worker import Rendezvous
from tandem.rollout.native import NativeRollout
from tandem.serving.client import DEAD_SERVER_ERRORS
from tandem.serving.remote import call
from tandem.serving.replica import ReplicaLayout, RolloutReplica, ServerOptions
from tandem.types import GenerateRequest

from transformers import AutoModelForCausalLM

from float_bounds import assert_within, token_logprob_bounds

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[25, 26, 27, 28], [29, 30, 31], [32, 33, 34, 35, 36]]
ONE_RANK = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
TWO_RANKS = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16,
                          tensor_model_parallel_size=2)


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


async def greedy(engine, prefix: str) -> list:
    return list(await asyncio.gather(*(engine.generate(GenerateRequest(f"{prefix}{i}", prompt,
                                                                       GREEDY))
                                       for i, prompt in enumerate(PROMPTS))))


async def one_rank(path) -> list:
    engine = NativeRollout.create(path, ONE_RANK)
    try:
        return await greedy(engine, "one")
    finally:
        await engine.shutdown()


def assert_same_as_one_rank(path, served: list, expected: list) -> None:
    """Greedy tokens equal; log-probs within twice the bound of any float32 forward of the
    model (test_engine_tensor_parallel.py says why: the all-reduces only reorder sums)."""
    assert [out.token_ids for out in served] == [out.token_ids for out in expected]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, two, one in zip(PROMPTS, served, expected):
        _, bound = token_logprob_bounds(hf, prompt, two.token_ids)
        assert_within(torch.tensor(two.log_probs), torch.tensor(one.log_probs), 2 * bound,
                      "TP=2 over two nodes vs TP=1")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_ranks_started_by_another_node_meet_rank_0_at_the_rendezvous(model_path):
    # "node 1": rank 1 started on its own (as a rank host does), before rank 0 opens the store
    port = free_port()
    workers = spawn_workers(range(1, 2), 2, "127.0.0.1", port, str(model_path), "float32",
                            [torch.device("cpu")], False, 1, "127.0.0.1")
    try:
        engine = NativeRollout.create(model_path, TWO_RANKS,
                                      rendezvous=Rendezvous("127.0.0.1", port, local_ranks=1))
        try:
            assert engine.ranks.processes == []  # rank 0 started none: its node runs only itself
            assert engine.stats()["tensor_parallel_ranks"] == 2
            assert_same_as_one_rank(model_path, await greedy(engine, "spread"),
                                    await one_rank(model_path))
        finally:
            await engine.shutdown()
        assert workers[0].wait(30) == 0  # rank 0's stop reached the other node's rank
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


async def test_a_replica_of_two_node_servers_serves_through_rank_0(ray_cluster, model_path):
    # Two bundles on the one node here stand for two nodes (the fleet reserves them
    # STRICT_SPREAD); a rank host on the second bundle, rank 0's server on the first.
    group = placement_group([{"CPU": 0.01}, {"CPU": 0.01}], strategy="PACK")
    await asyncio.wrap_future(group.ready().future())
    replica = RolloutReplica(0, TWO_RANKS, ServerOptions(model_path=str(model_path),
                                                         start_timeout_s=300))
    replica._begin(ReplicaLayout.STANDALONE)
    try:
        await replica._start_placed(group, [(0, {"CPU": 0.01}), (1, {"CPU": 0.01})])
        assert len(replica.servers) == 1 and len(replica.rank_hosts) == 1
        host = replica.rank_host_infos[0]
        assert host.ranks == [1] and len(host.rank_pids) == 1
        assert host.pid != replica.infos[0].pid  # rank 1 is the rank host's child, not rank 0's
        stats = await call(replica.main_server, "stats")
        assert stats["backend"]["tensor_parallel_ranks"] == 2
        served = await greedy(_Client(replica.main_server), "served")
        assert_same_as_one_rank(model_path, served, await one_rank(model_path))

        # the rank host's node goes away: its rank dies with it; rank 0's server then counts
        # as dead to the clients and to the health probe (weight_version), which restart it
        ray.kill(replica.rank_hosts[0], no_restart=True)
        await _wait_gone(host.rank_pids[0])
        with pytest.raises(ReplicaFailedError, match="tensor-parallel replica failed"):
            await asyncio.wait_for(call(replica.main_server, "generate", GenerateRequest(
                "after", [20, 21], GREEDY)), 120)
        with pytest.raises(DEAD_SERVER_ERRORS, match="must be restarted"):
            await call(replica.main_server, "weight_version", timeout_s=60)
    finally:
        replica.release()
        remove_placement_group(group)


class _Client:
    """generate() on a server actor, like the balancer's client."""

    def __init__(self, server) -> None:
        self.server = server

    async def generate(self, request: GenerateRequest):
        return await call(self.server, "generate", request)


async def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    for _ in range(math.ceil(timeout_s / 0.1)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"rank process {pid} outlived its rank host")
