"""Issue 13's fault tests: a process killed in the middle of a cross-process sync (gloo, shm).

A receiver killed mid-transfer: the sync fails within the deadline naming the phase and that
receiver; the other server keeps its old version and keeps serving; the next sync succeeds
(the dead server is left out). A sender killed mid-transfer: the receivers fail within the
deadline and keep their old weights. The actor's stream is slowed inside the training workers
so that the kill lands while buckets are moving.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from tandem.models import TinyModelSpec, build_tiny_model
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.weight_sync.base import WeightSyncError
from sync_fleet import GREEDY, PROMPTS, ROLLOUT, cross_process, start_actor, training_config
from tandem.types import GenerateRequest

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = 5.0
# several 1 MB buckets, so receivers hold part of the stream when the kill lands
SPEC = TinyModelSpec(hidden_size=128, num_hidden_layers=4, intermediate_size=1024)


def _slow_stream(worker, delay_s: float) -> None:
    """Make the actor's export yield one tensor per delay_s (test set-up inside the worker)."""
    export = type(worker.actor).export_weights

    def slow():
        for item in export(worker.actor):
            time.sleep(delay_s)
            yield item

    worker.actor.export_weights = slow


def _restore_stream(worker) -> None:
    del worker.actor.export_weights


@pytest.fixture(params=["gloo", "shm"])
def fleet(ray_cluster, request):
    path = build_tiny_model(SPEC)
    config = training_config(request.param, timeout_s=TIMEOUT_S)
    config.model.path = str(path)
    workers = start_actor(config)
    options = ServerOptions(model_path=str(path), device_bundle={"CPU": 0.01},
                            start_timeout_s=300)
    servers = asyncio.run(ServerManager.create(ROLLOUT, options, "standalone", total_devices=2))
    yield workers, servers, config.rollout.checkpoint_engine
    asyncio.run(servers.shutdown())  # a killed server's replica only drops its placement group
    for worker in workers:
        ray.kill(worker)


async def served(server, tag: str) -> list:
    return [await server.generate.remote(GenerateRequest(f"{tag}{i}", prompt, GREEDY))
            for i, prompt in enumerate(PROMPTS)]


async def until_receiving(server, tensors: int) -> None:
    deadline = time.monotonic() + 60
    while ((await server.stats.remote())["sync"] or {}).get("tensors_received", 0) < tensors:
        assert time.monotonic() < deadline, "the server never started receiving"
        await asyncio.sleep(0.01)


async def test_a_receiver_killed_mid_transfer(fleet):
    workers, servers, config = fleet
    survivor = servers.replicas["replica-0"].main_server
    victim = servers.replicas["replica-1"].main_server
    before = await served(survivor, "before")
    ray.get([w.__ray_call__.remote(_slow_stream, 0.1) for w in workers])
    manager = cross_process(workers, servers, config)
    start = time.monotonic()
    sync = asyncio.create_task(manager.sync(version=1))
    await until_receiving(victim, 1)
    ray.kill(victim)
    with pytest.raises(WeightSyncError) as failure:
        await sync
    elapsed = time.monotonic() - start
    print(f"{config.backend}: receiver killed: failed after {elapsed:.1f} s: {failure.value}")
    assert elapsed < 4 * TIMEOUT_S + 10  # the stream itself takes ~5 s at 0.1 s per tensor
    assert failure.value.phase in ("send", "receive", "finalize")
    assert failure.value.peer == "receiver 2 (replica-1)"
    assert "receiver 2 (replica-1): ActorDiedError" in str(failure.value)
    after = await served(survivor, "after")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert all(o.global_steps == 0 for o in after)
    ray.get([w.__ray_call__.remote(_restore_stream) for w in workers])
    report = await manager.sync(version=2)
    assert report.served == {"replica-0": 2, "replica-1": None}
    assert list(report.left_out) == ["replica-1"] and report.behind() == ["replica-1"]
    assert all(o.global_steps == 2 for o in await served(survivor, "next"))


async def test_a_sender_killed_mid_transfer(fleet):
    workers, servers, config = fleet
    server = servers.replicas["replica-0"].main_server
    before = await served(server, "before")
    ray.get([w.__ray_call__.remote(_slow_stream, 0.1) for w in workers])
    start = time.monotonic()
    sync = asyncio.create_task(cross_process(workers, servers, config).sync(version=1))
    await until_receiving(server, 1)
    ray.kill(workers[0])
    with pytest.raises(WeightSyncError) as failure:
        await sync
    elapsed = time.monotonic() - start
    print(f"{config.backend}: sender killed: failed after {elapsed:.1f} s: {failure.value}")
    # receivers give up TIMEOUT_S after the last bucket; rank 1, stuck in an FSDP gather of a
    # dead group, is given up 2 x TIMEOUT_S after them
    assert elapsed < 4 * TIMEOUT_S + 10
    assert failure.value.phase == "receive" and failure.value.peer == "sender rank 0"
    message = str(failure.value)
    assert "receiver 1 (replica-0): WeightSyncError" in message
    assert "receiver 2 (replica-1): WeightSyncError" in message
    assert await servers.servers_behind(0) == []
    for replica in servers.replicas.values():
        after = await served(replica.main_server, "after")
        assert [o.token_ids for o in after] == [o.token_ids for o in before]
        assert all(o.global_steps == 0 for o in after)
