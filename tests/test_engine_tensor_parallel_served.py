"""A TP=2 native replica as the fleet starts it: a standalone Ray server whose engine is rank 0 and
starts rank 1 as a process of its own, serving through the balancer and taking a cross-process
weight sync over the real shm transport from a training worker in this process (the seam's
phase order: abort, release KV, receive -> stage -> two-phase commit on both ranks, resume).
Rank 1 killed or stalled while a sync is under way: the sync fails within its deadline, naming
the replica, the rank and the phase, and rank 0 stays on the old version."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import torch

from tandem.config.schema import CheckpointEngineConfig, RolloutConfig, TandemConfig
from tandem.fleet.hybrid_worker import HybridWorker
from tandem.fleet.weight_sync import CrossProcessSync
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.manager import ServerManager
from tandem.serving.remote import call
from tandem.serving.replica import ServerOptions
from tandem.types import GenerateRequest
from tandem.weight_sync.base import WeightSyncError

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[25, 26, 27, 28], [29, 30, 31], [32, 33, 34, 35, 36]]
ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16,
                        tensor_model_parallel_size=2)


async def greedy(client, prefix: str) -> list:
    return list(await asyncio.gather(*(client.generate(GenerateRequest(f"{prefix}{i}", prompt,
                                                                       GREEDY))
                                       for i, prompt in enumerate(PROMPTS))))


async def one_rank_tokens(path) -> list[list[int]]:
    engine = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=8 << 20,
                                                      block_size=16))
    outputs = await greedy(engine, "one")
    await engine.shutdown()
    return [output.token_ids for output in outputs]


async def test_a_tp2_replica_on_ray_serves_and_takes_a_shm_sync(ray_cluster, tmp_path):
    path = build_tiny_model()
    options = ServerOptions(model_path=str(path), device_bundle={"CPU": 0.01},
                            start_timeout_s=300)
    servers = await ServerManager.create(ROLLOUT, options, "standalone", total_devices=2)
    try:
        assert len(servers.replicas) == 1  # one replica of two devices, two ranks
        stats = await servers.stats()
        assert [server["backend"]["tensor_parallel_ranks"] for server in stats.values()] == [2]
        served = await greedy(servers.client(), "before")
        assert [out.token_ids for out in served] == await one_rank_tokens(path)

        config = TandemConfig()
        config.model.path = str(path)
        config.rollout.checkpoint_engine = CheckpointEngineConfig(backend="shm", timeout_s=60.0)
        actor = HybridWorker(config)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in actor.actor.model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
        report = await CrossProcessSync([actor], servers, "shm", 60.0, {}).sync(version=1)
        assert report.served == {"replica-0": 1}, report

        after = await greedy(servers.client(), "after")
        actor.actor.model.save_pretrained(tmp_path / "actor")
        assert [out.token_ids for out in after] == await one_rank_tokens(tmp_path / "actor")
        assert [out.token_ids for out in after] != [out.token_ids for out in served]
        assert all(out.global_steps == 1 for out in after)
    finally:
        await servers.shutdown()


def worker_rank_pid(servers: ServerManager) -> int:
    """The pid of rank 1: the one worker process the replica's server process started."""
    server_pid = servers.replicas["replica-0"].infos[0].pid
    workers = [child for child in psutil.Process(server_pid).children()
               if "rank_worker" in " ".join(child.cmdline())]
    assert len(workers) == 1, workers
    return workers[0].pid


def signalling_after_first_tensor(export, pid: int, signum: int):
    """The actor's weight stream, sending `signum` to `pid` once its first tensor is out: the
    transfer has begun, and rank 1 is next needed at the commit."""
    def stream():
        for index, item in enumerate(export()):
            yield item
            if index == 0:
                os.kill(pid, signum)
    return stream


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
async def test_rank_1_lost_mid_sync_fails_the_sync_in_time_naming_replica_rank_and_phase(
        ray_cluster, signum):
    deadline_s = 8.0  # far below rank_worker.COLLECTIVE_TIMEOUT_S (300 s)
    path = build_tiny_model()
    ckpt = CheckpointEngineConfig(backend="shm", timeout_s=deadline_s)
    rollout = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16,
                            tensor_model_parallel_size=2, checkpoint_engine=ckpt)
    options = ServerOptions(model_path=str(path), device_bundle={"CPU": 0.01},
                            start_timeout_s=300)
    servers = await ServerManager.create(rollout, options, "standalone", total_devices=2)
    rank_1 = worker_rank_pid(servers)
    try:
        await greedy(servers.client(), "before")
        config = TandemConfig()
        config.model.path = str(path)
        config.rollout.checkpoint_engine = ckpt
        actor = HybridWorker(config)
        with torch.no_grad():
            for parameter in actor.actor.model.parameters():
                parameter.add_(0.1)
        actor.actor.export_weights = signalling_after_first_tensor(actor.actor.export_weights,
                                                                   rank_1, signum)
        started = time.perf_counter()
        with pytest.raises(WeightSyncError) as failure:
            await asyncio.wait_for(
                CrossProcessSync([actor], servers, "shm", deadline_s, {}).sync(version=1),
                4 * deadline_s)
        took = time.perf_counter() - started
        error = failure.value
        assert error.phase == "load" and "replica-0" in error.peer, error
        if signum == signal.SIGKILL:
            assert "rank 1 exited (code -9)" in str(error), str(error)
            assert took < deadline_s, took
        else:  # the engine's wait on rank 1 ends at the deadline, not the 300 s collective one
            assert f"rank 1 did not answer within {deadline_s} s" in str(error), error
            assert took < 2 * deadline_s, took  # before the seam's own 2 x deadline cut-off
        # rank 0 never installed: the surviving state is version 0; the replica reports failed
        server = servers.replicas["replica-0"].servers[0]
        stats = await call(server, "stats", timeout_s=deadline_s)
        assert stats["weight_version"] == 0
        assert "tensor-parallel replica failed: rank 1" in stats["backend"]["tensor_parallel_failure"]
    finally:
        if signum == signal.SIGSTOP and psutil.pid_exists(rank_1):
            os.kill(rank_1, signal.SIGKILL)  # a stopped process only takes SIGKILL
        await servers.shutdown()
