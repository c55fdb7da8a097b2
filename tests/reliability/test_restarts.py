"""Issue 42, "Engines come back": a server found dead or stalled is restarted in its placement,
serves the trainer's version before its first request and rejoins; requests that were on it
finish elsewhere or wait for it, none lost or generated twice; past the budget the run fails
naming the server. The elastic pool adds and removes replicas the same way.

Scripted servers on Ray (tokens are a function of the context and the weight version, so a
server on the wrong version shows in the tokens); `VersionSync` stands in for the seam.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import ray

import test_dead_servers
from tandem.config.schema import FaultToleranceConfig
from tandem.fleet.health import FleetHealth, ServerRestartError
from tandem.fleet.rollout_pool import RolloutPool, pressure_size, scheduled_size
from tandem.fleet.weight_sync import SyncReport
from tandem.serving.balancer import LoadBalancer, NoServerError, NoServerYet
from tandem.serving.manager import ServerManager
from tandem.serving.remote import call
from tandem.serving.replica import ServerOptions
from tandem.types import GenerateRequest
from test_dead_servers import CONFIG, scripted_backend  # noqa: F401
from test_serving_scripted import scripted_sequence, token_log_prob

ray.cloudpickle.register_pickle_by_value(test_dead_servers)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
INTERVAL_S = 0.5


class VersionSync:
    """The seam for scripted servers: abort, stamp `version` (no tensors), resume."""

    def __init__(self, manager: ServerManager) -> None:
        self.manager = manager
        self.calls: list[tuple[int, list[str]]] = []

    async def sync(self, version: int, replicas=None) -> SyncReport:
        replicas = list(self.manager.replicas.values() if replicas is None else replicas)
        self.calls.append((version, [r.server_id for r in replicas]))
        await self.manager.control("abort_all_requests", replicas=replicas)
        await asyncio.gather(*(call(server, "update_weights", [], version)
                               for replica in replicas for server in replica.servers))
        await self.manager.control("resume_generation", replicas=replicas)
        served = {r.server_id: await call(r.main_server, "weight_version") for r in replicas}
        return SyncReport(version, {"sync/total_s": 0.0}, served)


async def make_pool(servers: int, version: int = 3) -> tuple[RolloutPool, VersionSync]:
    options = ServerOptions(model_path="scripted:delay=0.005", device_bundle={"CPU": 0.01},
                            start_timeout_s=120, control_timeout_s=60)
    manager = await ServerManager.create(CONFIG, options, "standalone", total_devices=servers)
    sync = VersionSync(manager)
    pool = RolloutPool("rollout", manager, sync)
    await pool.sync(version)
    return pool, sync


async def start_health(pool, max_restarts: int = 3) -> FleetHealth:
    health = FleetHealth(FaultToleranceConfig(enable=True, max_restarts=max_restarts,
                                              health_interval_s=INTERVAL_S), [pool])
    await health.start()
    return health


async def stop(pool: RolloutPool, health: FleetHealth | None) -> None:
    if health is not None:
        await health.stop()
    await pool.stop()
    await pool.manager.shutdown()


def expect_exact(output, prompt, budget, version):
    """Every token the uninterrupted scripted model makes at `version`, once, with its logprob."""
    assert output.token_ids == scripted_sequence(prompt, budget, version)
    assert output.log_probs == [token_log_prob(t) for t in output.token_ids]
    assert output.extra_fields["min_global_steps"] == output.extra_fields["max_global_steps"] == version


async def generated(manager: ServerManager) -> int:
    return sum(s["backend"]["tokens_generated"] for s in (await manager.stats()).values())


async def until(predicate, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


# -- the balancer ------------------------------------------------------------------------------

def test_a_dead_server_that_will_restart_makes_requests_wait_not_fail() -> None:
    balancer = LoadBalancer()
    balancer.add_server("a")
    balancer.report_dead("a")
    with pytest.raises(NoServerError) as plain:  # restarts off: no server is an error
        balancer.acquire("x")
    assert not isinstance(plain.value, NoServerYet)
    balancer.add_server("b")
    balancer.restart_dead()
    balancer.report_dead("b")
    with pytest.raises(NoServerYet, match=r"\['b'\] restart"):
        balancer.acquire("x")
    balancer.expect("b-r1")
    balancer.expect("b", False)
    assert balancer.status().expected == ["b-r1"]
    balancer.add_server("b-r1")  # the restarted server: the expectation ends
    assert balancer.acquire("x") == "b-r1" and balancer.status().expected == []
    balancer.expect("c")
    balancer.expect(None)  # the fleet gave up: clients fail again
    balancer.remove_server("b-r1")
    with pytest.raises(NoServerError) as given_up:
        balancer.acquire("y")
    assert not isinstance(given_up.value, NoServerYet)


def test_the_pressure_adds_or_removes_one_replica_within_the_bounds() -> None:
    from tandem.config.schema import ElasticAutoConfig

    auto = ElasticAutoConfig(enable=True, min_replicas=1, max_replicas=3, grow_above=0.3,
                             shrink_above=0.5)
    assert pressure_size(2, 0.4, 0.0, auto, capacity=4) == 3  # the trainer waited: grow
    assert pressure_size(3, 0.9, 0.0, auto, capacity=4) == 3  # at max_replicas
    assert pressure_size(2, 0.1, 0.6, auto, capacity=4) == 1  # the rollout was held back
    assert pressure_size(1, 0.1, 0.9, auto, capacity=4) == 1  # at min_replicas
    assert pressure_size(2, 0.2, 0.4, auto, capacity=4) == 2  # neither past its threshold
    assert pressure_size(2, 0.4, 0.0, ElasticAutoConfig(enable=True), capacity=2) == 2
    assert pressure_size(4, 0.0, 0.0, auto, capacity=4) == 3  # back within max_replicas


async def test_separate_async_resizes_by_the_last_steps_idle_fractions() -> None:
    """Fleet.follow_pressure, which fit_separate_async calls after each sync with the previous
    step's record (none before the first step)."""
    from tandem.config.load import load_config
    from tandem.fleet.fleet import Fleet

    class Pool:
        sizes = [2]

        def size(self):
            return self.sizes[-1]

        async def resize(self, replicas):
            self.sizes.append(replicas)

    fleet = Fleet.__new__(Fleet)
    fleet.config = load_config(overrides=["trainer.trainer_mode=separate_async",
                                          "rollout.elastic.auto.enable=true", "rollout.nnodes=1",
                                          "rollout.n_gpus_per_node=3"])
    fleet.pool = Pool()
    await fleet.follow_pressure(None)
    for trainer_idle, rollout_idle in ((0.5, 0.0), (0.6, 0.0), (0.6, 0.0), (0.0, 0.8)):
        await fleet.follow_pressure({"idle/trainer_fraction": trainer_idle,
                                     "idle/rollout_fraction": rollout_idle})
    assert fleet.pool.sizes == [2, 3, 2]  # grown to the 3 devices' capacity, then shrunk


def test_the_schedule_gives_the_size_of_its_last_entry_reached() -> None:
    schedule = [[2, 3], [5, 1]]
    assert [scheduled_size(schedule, step) for step in range(7)] == [None, None, 3, 3, 3, 1, 1]
    assert scheduled_size([], 4) is None


# -- restarts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_the_only_server_killed_or_stalled_comes_back_at_the_version_and_no_request_is_lost(
        ray_cluster, scripted_backend, fault) -> None:  # noqa: F811
    pool, sync = await make_pool(servers=1, version=3)
    health = await start_health(pool)
    manager, victim = pool.manager, pool.manager.replicas["replica-0"]
    try:
        client = manager.resumable_client()
        prompts = {f"r{i}": [i + 1, 4] for i in range(12)}
        tasks = [asyncio.ensure_future(client.generate(GenerateRequest(r, p, {"max_tokens": 120})))
                 for r, p in prompts.items()]
        await until(lambda: _tokens_at_least(manager, 100))
        if fault == "kill":
            ray.kill(victim.main_server, no_restart=True)
        else:
            os.kill(victim.infos[0].pid, signal.SIGSTOP)  # alive, answering nothing
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for request_id, output in zip(prompts, outputs):
            expect_exact(output, prompts[request_id], 120, version=3)
        status = await manager.status()
        assert [load.server_id for load in status.servers] == ["replica-0-r1"]
        assert (status.stalled_servers if fault == "stop" else status.dead_servers) == ["replica-0"]
        assert status.expected == [] and sum(status.in_flight().values()) == 0
        assert await manager.weight_versions() == {"replica-0-r1": 3}
        assert health.restarts == 1 and health.metrics() == {"fleet/restarts": 1.0,
                                                             "fleet/restarts_total": 1.0}
        assert health.metrics()["fleet/restarts"] == 0.0  # counted once, in one step
        # it joined through the seam: loaded alone at the version the others serve
        assert sync.calls[-1] == (3, ["replica-0-r1"])
        new_pid = manager.replicas["replica-0-r1"].infos[0].pid
        assert new_pid != victim.infos[0].pid
        assert set(pool.members) == {"replica-0-r1"} and pool.restarting == 0
    finally:
        if fault == "stop":
            _continue(victim.infos[0].pid)
        await stop(pool, health)
    with pytest.raises(ProcessLookupError):  # the stalled process was killed, not left behind
        os.kill(victim.infos[0].pid, 0)


async def test_past_max_restarts_the_run_fails_naming_the_server_and_waiting_clients_fail(
        ray_cluster, scripted_backend) -> None:  # noqa: F811
    pool, _ = await make_pool(servers=1)
    health = await start_health(pool, max_restarts=0)
    try:
        client = pool.manager.resumable_client()
        task = asyncio.ensure_future(client.generate(GenerateRequest("w", [5], {"max_tokens": 400})))
        await until(lambda: _tokens_at_least(pool.manager, 10))
        ray.kill(pool.manager.replicas["replica-0"].main_server, no_restart=True)
        with pytest.raises(ServerRestartError, match=r"rollout server 'replica-0' died .*restart 1 of "
                                                     r"this run, past rollout.fault_tolerance."
                                                     r"max_restarts=0: the run stops"):
            await asyncio.wait_for(health.unless_failed(asyncio.sleep(60)), 30)
        with pytest.raises(NoServerError):  # it waited for the restart; the check gave up
            await asyncio.wait_for(task, 30)
        with pytest.raises(ServerRestartError):
            health.raise_if_failed()
    finally:
        await stop(pool, health)


async def test_a_restart_after_the_actor_moved_waits_for_the_next_sync(
        ray_cluster, scripted_backend) -> None:  # noqa: F811
    pool, sync = await make_pool(servers=2, version=4)
    health = await start_health(pool)
    try:
        await pool.actor_changes()  # an update began: the actor no longer holds version 4
        ray.kill(pool.manager.replicas["replica-1"].main_server, no_restart=True)
        await until(lambda: _async(pool.joining() == {"replica-1-r1"}))
        status = await pool.manager.status()
        assert [load.server_id for load in status.servers] == ["replica-0"]
        assert status.expected == ["replica-1-r1"]  # registered only once it serves the version
        assert pool.stuck() is None  # replica-0 still serves
        pool.awaiting_rollout = True
        await pool.manager.remove_replica("replica-0")  # no server left while the trainer waits
        assert "started but can only serve after the next weight sync (the actor has trained " \
               "past version 4" in pool.stuck()
        await pool.manager.add_replica(pool.members["replica-0"])
        pool.awaiting_rollout = False
        await pool.sync(5)  # the trainer's next sync: the others first, then the newcomer
        assert sync.calls[-2:] == [(5, ["replica-0"]), (5, ["replica-1-r1"])]
        assert await pool.manager.weight_versions() == {"replica-0": 5, "replica-1-r1": 5}
        assert pool.joining() == set() and (await pool.manager.status()).expected == []
        client = pool.manager.client()
        outputs = await asyncio.gather(*(client.generate(GenerateRequest(f"a{i}", [i + 2],
                                                                         {"max_tokens": 10}))
                                         for i in range(6)))
        assert all(o.token_ids == scripted_sequence([i + 2], 10, 5) for i, o in enumerate(outputs))
    finally:
        await stop(pool, health)


# -- the elastic pool ----------------------------------------------------------------------------

async def test_grow_and_shrink_under_load_every_new_replica_on_the_version_none_lost(
        ray_cluster, scripted_backend) -> None:  # noqa: F811
    pool, sync = await make_pool(servers=1, version=2)
    manager = pool.manager
    stopped_tokens = []  # what the removed replicas generated, read before they shut down
    stop_replicas = manager.stop_replicas

    async def counting_stop(replicas):
        answers = await manager.control("stats", replicas=replicas)
        stopped_tokens.extend(s[0]["backend"]["tokens_generated"] for s in answers.results.values())
        return await stop_replicas(replicas)

    manager.stop_replicas = counting_stop
    try:
        client = manager.resumable_client()
        first = {f"g{i}": [i + 1, 7] for i in range(8)}
        tasks = [asyncio.ensure_future(client.generate(GenerateRequest(r, p, {"max_tokens": 150})))
                 for r, p in first.items()]
        await pool.resize(3)  # 1 -> 3 while replica-0 generates
        assert sorted(manager.replicas) == ["replica-0", "replica-1", "replica-2"]
        assert sync.calls[-1] == (2, ["replica-1", "replica-2"])  # loaded before registration
        second = {f"h{i}": [i + 3, 1] for i in range(12)}
        tasks += [asyncio.ensure_future(client.generate(GenerateRequest(r, p, {"max_tokens": 150})))
                  for r, p in second.items()]
        await until(lambda: _all_busy(manager))
        served = {sid: s["requests"] for sid, s in (await manager.stats()).items()}
        assert served["replica-1"] > 0 and served["replica-2"] > 0  # new requests spread there
        await pool.resize(1)  # 3 -> 1 mid-generation: the newest go
        assert sorted(manager.replicas) == ["replica-0"] and len(stopped_tokens) == 2
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for (request_id, prompt), output in zip({**first, **second}.items(), outputs):
            expect_exact(output, prompt, 150, version=2)
        # the removed replicas' requests went on with their tokens: none generated twice
        assert await generated(manager) + sum(stopped_tokens) == 150 * 20
        status = await manager.status()
        assert status.retried_requests == 0 and status.dead_servers == []
        assert sum(o.extra_fields["resumes"] for o in outputs) >= 1
        with pytest.raises(ValueError, match="at least one serving replica stays"):
            await pool.remove(1)
    finally:
        await stop(pool, None)


async def _tokens_at_least(manager: ServerManager, count: int) -> bool:
    answers = await manager.control("stats", on_error="leave_out")
    return sum(s[0]["backend"]["tokens_generated"] for s in answers.results.values()) >= count


async def _all_busy(manager: ServerManager) -> bool:
    status = await manager.status()
    return all(load.in_flight for load in status.servers)


async def _async(value):
    return value


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


# -- served rewards come back too ------------------------------------------------------------

REWARD_SEQUENCES = [[5, 17, 230, 9, 44], [7] * 3, list(range(20, 83))]


@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_the_only_reward_server_killed_or_stalled_is_restarted_and_scores_again(
        ray_cluster, fault) -> None:
    from tandem.config.schema import RewardModelConfig
    from tandem.fleet.served_rewards import ServedRewards
    from tandem.models.tiny import build_tiny_reward_model
    from tandem.serving.reward_pool import RewardModelPool

    path = build_tiny_reward_model()
    pool = await RewardModelPool.create(str(path), RewardModelConfig(
        enable=True, path=str(path), n_devices=1), start_timeout_s=120)
    health = FleetHealth(FaultToleranceConfig(enable=True, health_interval_s=INTERVAL_S), [pool])
    await health.start()
    victim = pool.infos["reward-0"].pid
    try:
        client = pool.client(timeout_s=120)
        reference = await client.score("ref", REWARD_SEQUENCES)
        if fault == "kill":
            ray.kill(pool.servers["reward-0"], no_restart=True)
        else:
            os.kill(victim, signal.SIGSTOP)
        # calls made while it is down wait for the restart: every sample is scored
        results = await asyncio.wait_for(asyncio.gather(*(
            client.score(f"s{i}", REWARD_SEQUENCES) for i in range(4))), 120)
        assert all(result == pytest.approx(reference, abs=1e-6) for result in results)
        status = await pool.balancer.status.remote()
        assert [load.server_id for load in status.servers] == ["reward-0-r1"]
        assert (status.stalled_servers if fault == "stop" else status.dead_servers) == ["reward-0"]
        assert health.restarts == 1 and pool.infos["reward-0-r1"].pid != victim
        # the fleet's metrics count it
        rewards = ServedRewards.__new__(ServedRewards)
        rewards.reward_model, rewards.judge_pool = pool, None
        metrics = await rewards.fault_metrics()
        assert metrics[f"serving/reward_model_{'stalled' if fault == 'stop' else 'dead'}_servers"] == 1
        await rewards.check_serving()  # a server serves: nothing to say
    finally:
        _continue(victim)
        await health.stop()
        await pool.shutdown()


async def test_a_reward_pool_without_restarts_that_lost_its_last_server_stops_the_run(
        ray_cluster) -> None:
    from tandem.config.schema import RewardModelConfig
    from tandem.fleet.served_rewards import ServedRewardLost, ServedRewards
    from tandem.models.tiny import build_tiny_reward_model
    from tandem.serving.reward_pool import RewardModelPool

    path = build_tiny_reward_model()
    pool = await RewardModelPool.create(str(path), RewardModelConfig(
        enable=True, path=str(path), n_devices=1), start_timeout_s=120)
    rewards = ServedRewards.__new__(ServedRewards)
    rewards.reward_model, rewards.judge_pool = pool, None
    try:
        await rewards.check_serving()
        ray.kill(pool.servers["reward-0"], no_restart=True)
        with pytest.raises(NoServerError):  # restarts off: the call fails at once, no wait
            await pool.client().score("x", REWARD_SEQUENCES)
        with pytest.raises(ServedRewardLost, match=r"reward.model: no reward_model server is left "
                                                   r"\(reward-0 died\).*every later sample would "
                                                   r"fail its reward; the run stops. Set rollout."
                                                   r"fault_tolerance.enable=true"):
            await rewards.check_serving()
    finally:
        await pool.shutdown()


async def test_a_judge_replica_comes_back_without_a_weight_sync(
        ray_cluster, scripted_backend) -> None:  # noqa: F811
    options = ServerOptions(model_path="scripted:delay=0.005", device_bundle={"CPU": 0.01},
                            start_timeout_s=120, control_timeout_s=60)
    manager = await ServerManager.create(CONFIG, options, "standalone", total_devices=2)
    pool = RolloutPool("judge", manager, None)
    health = await start_health(pool)
    try:
        ray.kill(manager.replicas["replica-0"].main_server, no_restart=True)
        await until(lambda: _async("replica-0-r1" in manager.replicas))
        assert await manager.weight_versions() == {"replica-1": 0, "replica-0-r1": 0}
        output = await manager.client().generate(GenerateRequest("j", [3], {"max_tokens": 5}))
        assert output.token_ids == scripted_sequence([3], 5, 0)
    finally:
        await stop(pool, health)


# -- what the config refuses, and the one thing never restarted ---------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.fault_tolerance.enable=true"],
     r"rollout.fault_tolerance.enable: is true, but the rollout engines run inside the training "
     r"workers .* a training worker is never restarted: its death ends the run"),
    (["rollout.fault_tolerance.max_restarts=-1"], r"rollout.fault_tolerance.max_restarts: is -1"),
    (["rollout.fault_tolerance.health_interval_s=0"],
     r"rollout.fault_tolerance.health_interval_s: is 0.0; must be > 0"),
    (["rollout.elastic.schedule=[[2,3]]"],
     r"rollout.elastic.schedule: resizes the standalone rollout pool, but the rollout engines run "
     r"inside the training workers"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.schedule=[[2,3],[2,1]]"],
     r"rollout.elastic.schedule\[1\]: step 2 does not come after the previous entry's 2"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.schedule=[[2,0]]"],
     r"rollout.elastic.schedule\[0\]: 0 replicas at step 2; the pool keeps at least 1"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.schedule=[[2]]"],
     r"rollout.elastic.schedule\[0\]: is \[2\]; each entry is \[step, replicas\]"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.schedule=[[20,2]]"],
     r"its last entry is at step 20, after the run's last \(trainer.total_steps=10\)"),
    (["rollout.elastic.auto.enable=true", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"],
     r"rollout.elastic.auto.enable: is true, but trainer.trainer_mode='sync': the pressure it "
     r"follows .* exists only in separate_async"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.auto.enable=true",
      "rollout.nnodes=1", "rollout.n_gpus_per_node=2", "rollout.elastic.schedule=[[2,1]]"],
     r"rollout.elastic.schedule is set too, and both would size the pool; keep one"),
    (["trainer.trainer_mode=separate_async", "rollout.elastic.auto.enable=true",
      "rollout.nnodes=1", "rollout.n_gpus_per_node=2", "rollout.elastic.auto.max_replicas=3"],
     r"rollout.elastic.auto: min_replicas=1, max_replicas=3 \(0: 2, what the rollout devices "
     r"hold\); need 1 <= min_replicas <= max_replicas <= 2"),
    (["rollout.elastic.auto.grow_above=1.5"], r"rollout.elastic.auto.grow_above: is 1.5"),
])
def test_restart_and_elastic_options_that_cannot_run_are_refused_at_load(overrides, message):
    from tandem.config.load import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_options_that_run_load():
    from tandem.config.load import load_config

    config = load_config(overrides=["trainer.trainer_mode=separate_async",
                                    "rollout.fault_tolerance.enable=true",
                                    "rollout.elastic.schedule=[[0,2],[4,1]]"])
    assert config.rollout.fault_tolerance.max_restarts == 3
    assert config.rollout.elastic.schedule == [[0, 2], [4, 1]]
    # hybrid with a served reward of its own: its servers restart
    load_config(overrides=["rollout.fault_tolerance.enable=true", "reward.model.enable=true",
                           "reward.model.path=tiny:reward"])


async def test_a_dead_training_worker_ends_the_run_saying_it_is_never_restarted(tmp_path):
    from ray.exceptions import ActorDiedError

    from tandem.config.load import load_config
    from tandem.fleet.fleet import Fleet, TrainingWorkerLost
    from tandem.fleet.startup import StartupClock

    class DeadWorker:
        def update_actor(self, *args):
            raise ActorDiedError()

    fleet = Fleet(load_config(overrides=[]), tmp_path, StartupClock())
    fleet.workers, fleet.worker_addresses = [DeadWorker()], ["10.0.0.1:4242"]
    with pytest.raises(TrainingWorkerLost, match=r"update_actor: training worker 0 \(10.0.0.1:4242\) "
                                                 r"died \(ActorDiedError\).*never restarted.*resume "
                                                 r"it from its last checkpoint"):
        await fleet.on_workers("update_actor")
    with pytest.raises(RuntimeError, match=r"add_replicas: the rollout engines run inside the "
                                           r"training workers"):
        await fleet.add_replicas(1)
