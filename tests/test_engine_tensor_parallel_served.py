"""A TP=2 native replica as the fleet starts it: a standalone Ray server whose engine is rank 0 and
starts rank 1 as a process of its own, serving through the balancer and taking a cross-process
weight sync over the real shm transport from a training worker in this process (the seam's
phase order: abort, release KV, receive -> stage -> two-phase commit on both ranks, resume)."""

from __future__ import annotations

import asyncio

import torch

from tandem.config.schema import CheckpointEngineConfig, RolloutConfig, TandemConfig
from tandem.fleet.hybrid_worker import HybridWorker
from tandem.fleet.weight_sync import CrossProcessSync
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.types import GenerateRequest

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
