"""Issue 28, "a stalled server": alive but answering nothing (SIGSTOP), it is taken out of the
balancer by lack of progress and its requests run again elsewhere from the same prompt, so no
token is lost or generated twice; a slow server that still answers stays."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import ray

import test_dead_servers
from tandem.serving.client import ServerClient
from test_dead_servers import expect_exact, local_manager, scripted_backend  # noqa: F401
from tandem.types import GenerateRequest

ray.cloudpickle.register_pickle_by_value(test_dead_servers)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
STALL_S = 0.5


def stall_locally(manager, server_id: str) -> list[tuple]:
    """Make a local server answer nothing, as a SIGSTOPped process does; returns its calls."""
    calls: list[tuple] = []

    async def silent(*args):
        calls.append(args)
        await asyncio.Event().wait()

    server = manager.servers[server_id]
    server.generate = silent
    server.weight_version = silent
    return calls


def client_of(manager) -> ServerClient:
    client = manager.client()
    client.stall_timeout_s = STALL_S
    return client


async def test_a_stalled_server_leaves_and_its_requests_finish_elsewhere(scripted_backend) -> None:
    manager = await local_manager(servers=3)
    stalled = stall_locally(manager, "replica-1")
    client = client_of(manager)
    prompts = {f"r{i}": [i + 1, 2] for i in range(60)}
    first = await asyncio.gather(*(client.generate(GenerateRequest(r, prompts[r], {"max_tokens": 20}))
                                   for r in list(prompts)[:30]))
    generate_calls = [call for call in stalled if call and isinstance(call[0], GenerateRequest)]
    assert len(generate_calls) == 10  # spread 10/10/10 before the stall was seen
    second = await asyncio.gather(*(client.generate(GenerateRequest(r, prompts[r], {"max_tokens": 20}))
                                    for r in list(prompts)[30:]))
    assert len([call for call in stalled
                if call and isinstance(call[0], GenerateRequest)]) == 10  # none after it left
    for request_id, output in zip(prompts, first + second):
        expect_exact(output, prompts[request_id], 20)
    status = await manager.status()
    assert status.stalled_servers == ["replica-1"] and status.dead_servers == []
    assert status.retried_requests == 10 and status.removed_in_flight == 0
    assert status.in_flight() == {"replica-0": 0, "replica-2": 0}
    assert (await manager.fault_metrics())["serving/stalled_servers"] == 1.0


async def test_a_slow_server_that_answers_is_not_stalled(scripted_backend) -> None:
    manager = await local_manager(servers=2)
    server = manager.servers["replica-0"]
    original = server.generate

    async def slow(*args):
        await asyncio.sleep(4 * STALL_S)  # several probe periods without a result
        return await original(*args)

    server.generate = slow
    client = client_of(manager)
    outputs = await asyncio.gather(*(client.generate(GenerateRequest(f"s{i}", [i + 1], {"max_tokens": 8}))
                                     for i in range(4)))
    for i, output in enumerate(outputs):
        expect_exact(output, [i + 1], 8)
    status = await manager.status()
    assert status.stalled_servers == [] and status.retried_requests == 0


async def test_the_resumable_client_keeps_its_tokens_across_a_stall(scripted_backend) -> None:
    manager = await local_manager(servers=2)
    client = manager.resumable_client()
    client.client.stall_timeout_s = STALL_S
    task = asyncio.ensure_future(client.generate(GenerateRequest("keep", [3, 1], {"max_tokens": 300})))
    backend = manager.servers["replica-0"].backend
    for _ in range(500):
        if backend.stats()["tokens_generated"] >= 5:
            break
        await asyncio.sleep(0.01)
    # a weight sync aborts the request (its tokens so far come back), then its server stalls
    stall_locally(manager, "replica-0")
    await manager.servers["replica-0"].backend.abort_all()
    output = await asyncio.wait_for(task, 60)
    expect_exact(output, [3, 1], 300)
    kept = backend.stats()["tokens_generated"]
    continued = manager.servers["replica-1"].backend.stats()["tokens_generated"]
    assert kept >= 5 and kept + continued == 300  # nothing regenerated on the survivor
    assert (await manager.status()).stalled_servers == ["replica-0"]


@pytest.fixture
def ray_manager(ray_cluster, scripted_backend):  # noqa: F811
    from tandem.serving.manager import ServerManager
    from tandem.serving.replica import ServerOptions

    options = ServerOptions(model_path="scripted:delay=0.005", device_bundle={"CPU": 0.01},
                            start_timeout_s=120)
    manager = asyncio.run(ServerManager.create(test_dead_servers.CONFIG, options, "standalone",
                                               total_devices=3))
    yield manager
    asyncio.run(manager.shutdown())


@pytest.mark.slow
async def test_a_sigstopped_ray_server_is_routed_around(ray_manager) -> None:
    manager = ray_manager
    client = manager.resumable_client()
    client.client.stall_timeout_s = 2.0
    victim = manager.replicas["replica-1"].main_server
    pid = await victim.__ray_call__.remote(lambda actor: os.getpid())
    prompts = {f"load{i}": [i + 1, 3] for i in range(24)}
    tasks = [asyncio.ensure_future(client.generate(GenerateRequest(r, p, {"max_tokens": 100})))
             for r, p in prompts.items()]
    await asyncio.sleep(0.2)
    os.kill(pid, signal.SIGSTOP)
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for request_id, output in zip(prompts, outputs):
            expect_exact(output, prompts[request_id], 100)
        status = await manager.status()
        assert status.stalled_servers == ["replica-1"]
        expect_exact(await client.generate(GenerateRequest("after", [2], {"max_tokens": 5})), [2], 5)
    finally:
        os.kill(pid, signal.SIGCONT)
