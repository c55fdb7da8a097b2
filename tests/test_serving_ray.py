"""The serving layer on a real local Ray cluster, with the scripted backend (no compute).

Four standalone servers are started once for the module; each test leaves them as it found
them (all registered, generation open, nothing in flight).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

import test_serving_scripted
from tandem.config.schema import RolloutConfig
from tandem.rollout import registry
from tandem.serving.balancer import LoadBalancerActor, NoServerError
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ReplicaLayout, ServerOptions
from tandem.serving.server import RolloutServer
from test_serving_scripted import load_weights, token_log_prob
from tandem.types import GenerateRequest

# Test modules are not importable inside Ray workers: ship their classes by value.
ray.cloudpickle.register_pickle_by_value(test_serving_scripted)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = RolloutConfig(name="scripted")
TINY_BUNDLE = {"CPU": 0.01}  # four servers and more fit on two cores


@pytest.fixture(scope="module")
def scripted_backend():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry._ROLLOUT_BACKENDS, "scripted",
                      "test_serving_scripted:ScriptedRollout")
        yield


@pytest.fixture(scope="module")
def manager(ray_cluster, scripted_backend):
    options = ServerOptions(model_path="scripted:delay=0.005", device_bundle=TINY_BUNDLE,
                            start_timeout_s=120)
    manager = asyncio.run(ServerManager.create(CONFIG, options, "standalone", total_devices=4))
    yield manager
    asyncio.run(manager.shutdown())


async def in_flight_total(manager: ServerManager) -> int:
    status = await manager.status()
    return sum(status.in_flight().values()) + status.removed_in_flight


async def backend_stats(manager: ServerManager) -> dict[str, dict]:
    return {sid: stats["backend"] for sid, stats in (await manager.stats()).items()}


async def request_ids(manager: ServerManager, replica) -> list[str]:
    """Every request id a replica's engine was asked for (also one out of the balancer)."""
    answers = await manager.control("stats", replicas=[replica])
    return answers.results[replica.server_id][0]["backend"]["request_ids"]


async def test_four_standalone_replicas_each_in_its_own_placement_group(manager) -> None:
    infos = [replica.infos[0] for replica in manager.replicas.values()]
    assert [replica.server_id for replica in manager.replicas.values()] == [
        "replica-0", "replica-1", "replica-2", "replica-3"]
    assert len({info.pid for info in infos}) == 4 and os.getpid() not in {i.pid for i in infos}
    assert {info.placement_group_id for info in infos} == {
        replica.placement_group.id.hex() for replica in manager.replicas.values()}
    assert all(info.backend == "ScriptedRollout" for info in infos)


async def test_turns_of_a_conversation_stick_to_one_server(manager) -> None:
    client = manager.client()

    async def conversation(name: str) -> None:
        prompt = [1, 2, 3]
        for _ in range(3):
            out = await client.generate(GenerateRequest(name, prompt, {"max_tokens": 4}))
            prompt = prompt + out.token_ids + [7]

    await asyncio.gather(*(conversation(f"conv{i}") for i in range(12)))
    servers_of = {}
    for server_id, stats in (await backend_stats(manager)).items():
        for backend_id in stats["request_ids"]:
            if backend_id.startswith("conv"):
                servers_of.setdefault(backend_id.split("-")[0], Counter())[server_id] += 1
    assert len(servers_of) == 12
    assert all(list(counts.values()) == [3] for counts in servers_of.values())
    assert len({next(iter(c)) for c in servers_of.values()}) == 4  # and they were spread out


async def test_200_concurrent_requests_spread_evenly_over_four_servers(manager) -> None:
    before = {load.server_id: load.requests for load in (await manager.status()).servers}
    client = manager.client()
    tasks = [asyncio.ensure_future(client.generate(GenerateRequest(f"spread{i}", [i + 1], {"max_tokens": 200})))
             for i in range(200)]
    peak = {}
    for _ in range(500):
        status = await manager.status()
        if sum(status.in_flight().values()) == 200:
            peak = status.in_flight()
            break
        await asyncio.sleep(0.01)
    assert peak, "the 200 requests were never in flight together"
    assert max(peak.values()) / min(peak.values()) <= 1.1, peak
    outputs = await asyncio.gather(*tasks)
    assert all(len(out.token_ids) == 200 for out in outputs)
    served = {load.server_id: load.requests - before[load.server_id]
              for load in (await manager.status()).servers}
    assert sum(served.values()) == 200 and min(served.values()) >= 45, served
    assert await in_flight_total(manager) == 0


async def test_in_flight_counts_return_to_zero_after_errors_and_cancellations(manager) -> None:
    client = manager.client()
    bad = [client.generate(GenerateRequest(f"bad{i}", [-1], {"max_tokens": 2})) for i in range(8)]
    results = await asyncio.gather(*bad, return_exceptions=True)
    assert all(isinstance(r, ValueError) and "non-empty" in str(r) for r in results)
    doomed = [asyncio.ensure_future(client.generate(GenerateRequest(f"doomed{i}", [1], {"max_tokens": 100_000})))
              for i in range(8)]
    for _ in range(500):
        if sum((s["running"] for s in (await backend_stats(manager)).values())) == 8:
            break
        await asyncio.sleep(0.01)
    for task in doomed:
        task.cancel()
    await asyncio.gather(*doomed, return_exceptions=True)
    with pytest.raises(TimeoutError):
        await manager.client(timeout_s=0.2).generate(GenerateRequest("slow", [1], {"max_tokens": 100_000}))
    # Cancelled while the balancer's answer is still on its way: released once it arrives.
    early = [asyncio.ensure_future(client.generate(GenerateRequest(f"early{i}", [1], {"max_tokens": 100_000})))
             for i in range(20)]
    await asyncio.sleep(0)
    for task in early:
        task.cancel()
    await asyncio.gather(*early, return_exceptions=True)
    for _ in range(500):
        if (await in_flight_total(manager) == 0
                and sum(s["running"] for s in (await backend_stats(manager)).values()) == 0):
            break
        await asyncio.sleep(0.01)
    assert await in_flight_total(manager) == 0
    # ray.cancel reached the servers: the engines stopped those requests.
    assert sum(s["running"] for s in (await backend_stats(manager)).values()) == 0
    assert sum(s["cancelled"] for s in (await manager.stats()).values()) == 9


async def test_a_client_shipped_to_another_ray_process_reaches_the_servers(manager) -> None:
    @ray.remote(num_cpus=0)
    def agent_loop_worker(client) -> tuple[int, int]:
        first = asyncio.run(client.generate(GenerateRequest("remote", [1, 2], {"max_tokens": 6})))
        return len(first.token_ids), os.getpid()

    length, pid = await agent_loop_worker.remote(manager.resumable_client())
    assert length == 6 and pid != os.getpid()
    assert await in_flight_total(manager) == 0


async def test_a_client_without_the_servers_gets_their_handles_from_the_balancer(manager) -> None:
    """The balancer keeps each server's handle as an object reference (its process never loads
    the server's class); a client that was not given the servers resolves them through it."""
    from tandem.serving.client import ServerClient

    registered = await manager.balancer.server_handle.remote("replica-0")
    assert len(registered) == 1 and isinstance(registered[0], ray.ObjectRef)
    client = ServerClient(manager.balancer, {})
    outputs = [await client.generate(GenerateRequest(f"lookup{i}", [1, 2], {"max_tokens": 3})) for i in range(4)]
    assert all(len(out.token_ids) == 3 for out in outputs)
    assert set(client.servers) <= set(manager.replicas) and client.servers
    assert all(isinstance(handle, ray.actor.ActorHandle) for handle in client.servers.values())
    assert await in_flight_total(manager) == 0


async def test_removing_a_server_mid_run_reroutes_without_losing_requests(manager) -> None:
    client = manager.resumable_client()

    async def two_turns(name: str) -> list:
        first = await client.generate(GenerateRequest(name, [5], {"max_tokens": 60}))
        second = await client.generate(GenerateRequest(name, [5, *first.token_ids, 8], {"max_tokens": 20}))
        return [first, second]

    tasks = [asyncio.ensure_future(two_turns(f"move{i}")) for i in range(40)]
    await asyncio.sleep(0.1)
    removed = await manager.remove_replica("replica-3", abort=True)
    seen_at_removal = await request_ids(manager, removed)
    results = await asyncio.gather(*tasks)
    try:
        assert all(len(a.token_ids) == 60 and len(b.token_ids) == 20 for a, b in results)
        assert sum(a.extra_fields["resumes"] for a, _ in results) >= 1  # some were moved
        assert [load.server_id for load in (await manager.status()).servers] == [
            "replica-0", "replica-1", "replica-2"]
        assert await in_flight_total(manager) == 0
        # Nothing new reached the removed server's engine after its removal.
        assert await request_ids(manager, removed) == seen_at_removal
    finally:
        await manager.control("resume_generation", replicas=[removed])
        await manager.add_replica(removed)


async def test_no_server_left_is_a_clear_error_over_ray(ray_cluster, scripted_backend) -> None:
    manager = ServerManager(CONFIG, ServerOptions("scripted"), ReplicaLayout.STANDALONE,
                            LoadBalancerActor.remote())
    with pytest.raises(NoServerError, match="no servers"):
        await manager.client().generate(GenerateRequest("x", [1], {"max_tokens": 1}))
    await manager.shutdown()


async def test_partial_rollout_abort_update_resume_loses_and_repeats_nothing(manager) -> None:
    client = manager.resumable_client()
    before = await backend_stats(manager)
    tasks = [asyncio.ensure_future(client.generate(GenerateRequest(f"partial{i}", [i + 1], {"max_tokens": 150})))
             for i in range(32)]
    for _ in range(500):
        if sum(s["running"] for s in (await backend_stats(manager)).values()) == 32:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # every request has tokens of version 0 by now (5 ms per token)
    assert sum(sum(n) for n in (await manager.control("abort_all_requests")).results.values()) == 32
    await load_weights(manager, [("w", torch.ones(4))], 1)
    await manager.control("resume_generation")
    outputs = await asyncio.gather(*tasks)
    after = await backend_stats(manager)
    assert all(len(o.token_ids) == len(o.log_probs) == 150 for o in outputs)
    assert all(o.log_probs == [token_log_prob(t) for t in o.token_ids] for o in outputs)
    interrupted = [o for o in outputs if o.extra_fields["resumes"]]
    assert len(interrupted) == 32
    assert all(o.extra_fields["min_global_steps"] == 0 < o.extra_fields["max_global_steps"] == 1
               for o in interrupted)
    generated = sum(after[s]["tokens_generated"] - before[s]["tokens_generated"] for s in after)
    assert generated == 32 * 150  # no token generated twice
    await load_weights(manager, [("w", torch.zeros(4))], 0)  # leave version 0 behind


class TrainingWorker(RolloutServer):
    """Stands in for a hybrid training worker: its own process also hosts the engine."""

    def __init__(self) -> None:
        self._init_rollout_server("trainer-0", pause_timeout_s=60.0, drain_timeout_s=10.0)
        self.steps = 0

    def train_step(self) -> tuple[int, int]:
        self.steps += 1
        return self.steps, os.getpid()


async def test_hybrid_engine_lives_in_the_training_worker_process(ray_cluster,
                                                                  scripted_backend) -> None:
    worker = ray.remote(num_cpus=0, max_concurrency=100)(TrainingWorker).remote()
    manager = await ServerManager.create(CONFIG, ServerOptions("scripted:delay=0.001"), "hybrid",
                                         hosts=[worker])
    try:
        out = await manager.client().generate(GenerateRequest("h", [1], {"max_tokens": 5}))
        steps, pid = await worker.train_step.remote()
        assert len(out.token_ids) == 5 and steps == 1
        assert manager.replicas["replica-0"].infos[0].pid == pid
        await manager.control("sleep", ["weights", "kv_cache"])
        await manager.control("wake_up", ["weights", "kv_cache"])
        assert len((await manager.client().generate(GenerateRequest("h", [1], {"max_tokens": 2}))).token_ids) == 2
    finally:
        await manager.shutdown()
        ray.kill(worker)


async def test_colocated_server_shares_another_roles_placement_group(ray_cluster,
                                                                     scripted_backend) -> None:
    group = placement_group([{"CPU": 0.02}], strategy="STRICT_PACK")
    manager = await ServerManager.create(CONFIG, ServerOptions("scripted:delay=0.001"),
                                         "colocated", placement_group=group)
    try:
        (replica,) = manager.replicas.values()
        assert replica.infos[0].placement_group_id == group.id.hex()
        assert len((await manager.client().generate(GenerateRequest("c", [1], {"max_tokens": 3}))).token_ids) == 3
    finally:
        await manager.shutdown()
        remove_placement_group(group)


@ray.remote
class _Sleeper:
    async def sleep(self, seconds: float) -> int:  # an async actor method, as the servers' generate
        await asyncio.sleep(seconds)
        return 1


async def test_a_cancelled_remote_call_leaves_no_unretrieved_exception(ray_cluster) -> None:
    """Cancelling the caller cancels the Ray task; its TaskCancelledError is read when it lands,
    so asyncio never logs 'Future exception was never retrieved' (which the async modes printed
    once per aborted generate at exit)."""
    import gc

    from tandem.serving.remote import resolve

    loop = asyncio.get_running_loop()
    logged: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: logged.append(context))
    try:
        pending = _Sleeper.remote().sleep.remote(30)
        waiter = asyncio.ensure_future(resolve(pending))
        await asyncio.sleep(0.5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
            await asyncio.wait_for(asyncio.wrap_future(pending.future()), 20)
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    # (other tests' garbage, collected here, may log its own unretrieved exceptions: only Ray's count)
    ours = [c for c in logged if "never retrieved" in c.get("message", "")
            and isinstance(c.get("exception"), ray.exceptions.RayError)]
    assert not ours, ours
