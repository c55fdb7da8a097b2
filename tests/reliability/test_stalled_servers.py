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


# -- issue 42: the trainer's wait on a pool that answers nothing ends at the deadline ---------

def fleet_of(manager, timeout_s: float):
    from pathlib import Path

    from tandem.config.load import load_config
    from tandem.fleet.fleet import Fleet
    from tandem.fleet.startup import StartupClock

    config = load_config(overrides=[f"rollout.checkpoint_engine.timeout_s={timeout_s}"])
    fleet = Fleet(config, Path("unused"), StartupClock())
    fleet.rollout = manager
    return fleet


async def test_waiting_on_a_pool_that_answers_nothing_stops_at_the_deadline_naming_it(
        scripted_backend) -> None:
    from tandem.serving.remote import NoAnswerError

    manager = await local_manager(servers=1)
    stall_locally(manager, "replica-0")
    fleet = fleet_of(manager, timeout_s=0.5)
    began = asyncio.get_running_loop().time()
    with pytest.raises(NoAnswerError) as failure:
        await fleet.while_rollout_answers(asyncio.Event().wait(), "wait_rollout")
    assert asyncio.get_running_loop().time() - began < 0.5 + 1.0
    message = str(failure.value)
    assert message.startswith("wait_rollout: no rollout server answered within 0.5 s "
                              "(rollout.checkpoint_engine.timeout_s)"), message
    assert "replica-0: ControlTimeout: weight_version() on server 'replica-0'" in message
    assert (await manager.status()).stalled_servers == ["replica-0"]
    # the stopped server is not asked to shut down (release() ends it), and nothing is raised
    asked = []
    manager.servers["replica-0"].shutdown = lambda: asked.append("shutdown")
    await manager.shutdown()
    assert asked == []


async def test_a_pool_that_answers_is_waited_for_however_long_it_generates(scripted_backend) -> None:
    manager = await local_manager(servers=2)
    stall_locally(manager, "replica-1")  # one of two: the other keeps the pool alive
    fleet = fleet_of(manager, timeout_s=0.2)

    async def slow_groups():
        await asyncio.sleep(1.5)  # several deadlines long
        return "groups"

    assert await fleet.while_rollout_answers(slow_groups(), "wait_rollout") == "groups"


async def test_with_fault_tolerance_the_health_check_watches_the_wait_instead(
        scripted_backend) -> None:
    """rollout.fault_tolerance: a silent pool is the health check's to restart, so the wait
    outlives the weight_version deadline and ends only with the check's failure."""
    from tandem.fleet.health import FleetHealth, ServerRestartError

    manager = await local_manager(servers=1)
    stall_locally(manager, "replica-0")
    fleet = fleet_of(manager, timeout_s=0.2)
    fleet.health = FleetHealth(fleet.config.rollout.fault_tolerance, [])

    async def groups_after_a_restart():
        await asyncio.sleep(1.0)  # five deadlines long
        return "groups"

    assert await fleet.while_rollout_answers(groups_after_a_restart(), "wait_rollout") == "groups"
    assert (await manager.status()).stalled_servers == []  # not reported: the check decides

    async def fail_soon():
        await asyncio.sleep(0.1)
        await fleet.health._fail(ServerRestartError("replica-0 stalled; past max_restarts=0"))

    failing = asyncio.ensure_future(fail_soon())
    with pytest.raises(ServerRestartError, match="past max_restarts=0"):
        await fleet.while_rollout_answers(asyncio.Event().wait(), "wait_rollout")
    await failing


async def test_a_server_silent_at_shutdown_is_killed_not_raised(scripted_backend, caplog) -> None:
    manager = await local_manager(servers=2)
    stall_locally(manager, "replica-1")

    async def silent():
        await asyncio.Event().wait()

    manager.servers["replica-1"].shutdown = silent
    for replica in manager.replicas.values():
        replica.options.control_timeout_s = 0.3
    with caplog.at_level("WARNING"):
        await manager.shutdown()
    assert "shutdown() on server 'replica-1'" in caplog.text and "killed" in caplog.text
