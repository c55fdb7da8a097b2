"""Issue 42 end to end on a tiny model, trainer_mode=separate_async: standalone servers SIGKILLed
and SIGSTOPped mid-run are restarted, re-synced and rejoin while training goes on
(rollout.fault_tolerance), past the budget the run fails naming the server; the pool grows from
1 to 3 replicas and back (rollout.elastic.schedule) and grows when the trainer waits on rollout
(rollout.elastic.auto), each new replica on the trainer's version
before its first request. No trajectory is lost or trained twice, and the tokens the engines
returned are exactly the trained ones; a 30-step soak strikes at a seeded random schedule, and a
soak of hundreds of multi-turn sessions does so in separate_async and colocate_async alike. About
8 minutes; run by `make test-isolated` in a pytest
process of its own, since the pool of three replicas needs the session cluster's 4 CPUs free of
earlier tests' actors (after the default or slow suite it timed out waiting for them)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter

import pytest
from test_trainer_colocate_async import CountingClient
from test_trainer_sync import tiny_config

from tandem.config.load import load_config
from tandem.fleet.health import ServerRestartError
from tandem.serving.remote import call
from tandem.trainer.metrics import read_metrics
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.colocate_async import fit_colocate_async
from tandem.trainer.separate_async import fit_separate_async
from tandem.types import GenerateRequest

QUICK = ["trainer.trainer_mode=separate_async", "rollout.multi_turn.enable=false",
         "rollout.multi_turn.tools=[]", "rollout.response_length=24",
         "trainer.async_rollout.max_staleness=2", "data.val_files=[]"]
FAULTS = ["rollout.fault_tolerance.enable=true", "rollout.fault_tolerance.health_interval_s=1"]

pytestmark = pytest.mark.isolated  # make test-isolated: a Ray cluster of its own


async def until(predicate, timeout_s: float = 120.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


class Run:
    """A trainer with spies: trained trajectories, the tokens the client got back, and hooks
    called after the sync of a version (`after_sync[version]`) or in a step's first update
    (`in_update[step]`)."""

    def __init__(self, config) -> None:
        self.trainer = RLTrainer(config)
        self.trained: list[tuple[str, int, int]] = []  # (uid, session, policy tokens)
        # per update: (uid, session, its oldest policy token's version, stop reason, turns)
        self.batches: list[list[tuple[str, int, int, str, int]]] = []
        self.after_sync: dict[int, object] = {}
        self.in_update: dict[int, object] = {}
        self.counter: CountingClient | None = None
        self.joined: list[tuple[str, int, int, int]] = []  # see spy_joins
        self.stopped: list[int] = []  # pids SIGSTOPped by strike_at's faults

    async def start(self) -> None:
        trainer = self.trainer
        await trainer.start()
        self.counter = CountingClient(trainer.runner.loop.client.client)
        trainer.runner.loop.client.client = self.counter
        make_batch, sync, update = trainer.make_batch, trainer.fleet.sync_weights, trainer.update

        def batch_spy(trajectories):
            self.trained += [(t.uid, t.session_id, int(t.response_mask.sum())) for t in trajectories]
            self.batches.append([(t.uid, t.session_id,
                                  int(t.response_versions[t.response_mask.bool()].min()),
                                  t.stop_reason, t.num_turns) for t in trajectories])
            return make_batch(trajectories)

        async def sync_spy(version):
            metrics = await sync(version)
            hook = self.after_sync.pop(version, None)
            if hook is not None:
                await hook()
            return metrics

        async def update_spy(batch):
            hook = self.in_update.pop(trainer.step, None)
            if hook is not None:
                await hook()
            return await update(batch)

        trainer.make_batch, trainer.fleet.sync_weights, trainer.update = batch_spy, sync_spy, update_spy

    def strike_at(self, plan: list[tuple[int, str, str]], rng: random.Random,
                  timeout_s: float = 120.0) -> None:
        """Register `plan`'s faults, (step, "kill" | "stop", "in_update" | "after_sync"): each
        SIGKILLs or SIGSTOPs a random replica, then waits until its restart serves and the pool
        has its size again (restarts counts a restart when it begins)."""
        fleet = self.trainer.fleet
        size = len(fleet.rollout.replicas)

        def fault(kind: str, expected_restarts: int):
            async def strike():
                victim = rng.choice(sorted(fleet.rollout.replicas))
                replica = fleet.rollout.replicas[victim]
                if kind == "kill":
                    ray_kill(replica.main_server)
                else:
                    self.stopped.append(replica.infos[0].pid)
                    os.kill(self.stopped[-1], signal.SIGSTOP)
                await until(lambda: fleet.health.restarts == expected_restarts
                            and victim not in fleet.rollout.replicas
                            and len(fleet.rollout.replicas) == size, timeout_s)
            return strike

        for number, (step, kind, where) in enumerate(plan, start=1):
            getattr(self, where)[step] = fault(kind, number)

    def spy_joins(self) -> None:
        """From now on, record in `joined` each replica the pool adds, as it registers:
        (server_id, its version, the pool's, requests it had served)."""
        pool = self.trainer.fleet.pool
        add_replica = pool.manager.add_replica

        async def spy(replica):
            stats = await call(replica.main_server, "stats")
            self.joined.append((replica.server_id, stats["weight_version"], pool.version,
                                stats["requests"]))
            await add_replica(replica)

        pool.manager.add_replica = spy

    def check_whole(self) -> None:
        """Every group of every step trained once, with exactly the tokens the client got."""
        config = self.trainer.config
        keys = Counter((uid, session) for uid, session, _ in self.trained)
        assert len(keys) == config.trainer.total_steps * config.data.train_batch_size * config.rollout.n
        assert set(keys.values()) == {1}
        for uid, session, tokens in self.trained:
            assert self.counter.tokens[f"{uid}-{session}"] == tokens

    async def greedy_per_replica(self) -> dict[str, tuple[int, list[int], list[int]]]:
        """server_id -> (its version, its greedy tokens, the actor's) on one prompt."""
        trainer = self.trainer
        prompt = trainer.runner.loop.chat_format.prompt_ids(trainer.train_rows(0)[0].messages)
        actor = await trainer.workers[0].actor_greedy.remote(prompt, 8)
        answers = {}
        for server_id, replica in trainer.fleet.rollout.replicas.items():
            output = await call(replica.main_server, "generate", GenerateRequest(
                f"greedy-{server_id}", prompt, {"temperature": 0.0, "max_tokens": 8}))
            answers[server_id] = (output.extra_fields["global_steps"], output.token_ids, actor)
        return answers


def records_of(tmp_path) -> list[dict]:
    return [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/update" in r]


def test_killed_and_stalled_servers_come_back_on_the_trainers_version(tmp_path, ray_cluster):
    config = tiny_config(tmp_path, *QUICK, *FAULTS, "trainer.total_steps=8",
                         "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
                         "rollout.fault_tolerance.max_restarts=2")
    run = Run(config)
    stopped = []

    async def main():
        await run.start()
        fleet = run.trainer.fleet

        async def kill_mid_step():  # the actor is moving on: the new one joins at the next sync
            ray_kill(fleet.rollout.replicas["replica-1"].main_server)
            await until(lambda: fleet.health.restarts == 1)

        async def stall_after_sync():  # the actor holds the version: the new one loads it now
            stopped.append(fleet.rollout.replicas["replica-0"].infos[0].pid)
            os.kill(stopped[0], signal.SIGSTOP)
            await until(lambda: "replica-0-r1" in fleet.rollout.replicas)

        run.in_update[2] = kill_mid_step
        run.after_sync[5] = stall_after_sync
        try:
            await fit_separate_async(run.trainer)
            return run.trainer.step, await run.greedy_per_replica()
        finally:
            if stopped:
                _continue(stopped[0])
            await run.trainer.stop()

    step, greedy = asyncio.run(main())
    assert step == 8
    # both restarted, both serve the trainer's version: greedy tokens are the actor's
    assert sorted(greedy) == ["replica-0-r1", "replica-1-r1"]
    for version, tokens, actor in greedy.values():
        assert version == 8 and tokens == actor
    run.check_whole()
    records = records_of(tmp_path)
    assert [r["fleet/restarts_total"] for r in records][-1] == 2
    assert sum(r["fleet/restarts"] for r in records) == 2
    assert records[-1]["serving/dead_servers"] == 1 and records[-1]["serving/stalled_servers"] == 1
    assert all(r["fleet/replicas"] == 2 for r in records)
    assert all(r["weight_version"] == r["step"] for r in records)
    with pytest.raises(ProcessLookupError):
        os.kill(stopped[0], 0)  # the stalled process was killed


def test_a_30_step_run_survives_a_seeded_schedule_of_kills_and_stalls(tmp_path, ray_cluster):
    """The soak: SIGKILLs and SIGSTOPs of random replicas at random steps (a seed fixes the
    schedule), some in the middle of an update and some right after a sync. The run finishes,
    each fault costs exactly one restart, every replica ends on the trainer's version with the
    actor's greedy tokens, and no trajectory is lost or trained twice."""
    rng = random.Random(37)
    total, faults = 30, sorted(rng.sample(range(2, 29), 5))
    plan = [(step, rng.choice(("kill", "stop")), rng.choice(("in_update", "after_sync")))
            for step in faults]
    config = tiny_config(tmp_path, *QUICK, *FAULTS, f"trainer.total_steps={total}",
                         "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
                         f"rollout.fault_tolerance.max_restarts={len(plan)}")
    run = Run(config)

    async def main():
        await run.start()
        run.strike_at(plan, rng)
        try:
            await fit_separate_async(run.trainer)
            return run.trainer.step, await run.greedy_per_replica()
        finally:
            for pid in run.stopped:
                _continue(pid)
            await run.trainer.stop()

    step, greedy = asyncio.run(main())
    print("fault plan (step, fault, where):", plan)
    assert step == total
    assert len(greedy) == 2  # the pool kept its size through every restart
    for version, tokens, actor in greedy.values():
        assert version == total and tokens == actor
    run.check_whole()
    records = records_of(tmp_path)
    assert records[-1]["fleet/restarts_total"] == len(plan)
    assert all(r["weight_version"] == r["step"] for r in records)
    for pid in run.stopped:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every stalled process was killed, none left behind


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set size (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("mode", ["separate_async", "colocate_async"])
def test_a_soak_of_hundreds_of_multi_turn_sessions_survives_kills_and_stalls(
        tmp_path, ray_cluster, mode):
    """The soak of issue 42 in both async modes: the demo's tool-calling model, 128 multi-turn
    sessions a step and up to three steps of them outstanding (max_staleness=2), a pause and
    resume at every one of 10 syncs, and a seeded schedule of SIGKILLs and SIGSTOPs of random
    replicas at random points (in an update, right after a sync). The run finishes; every
    trained trajectory is complete, trained once with exactly the tokens the client got and
    within the staleness bound; the driver's memory after the last step is within 10% of
    after the warm-up."""
    from tandem.demo.tasks import make_datasets

    train, _ = make_datasets(tmp_path / "data", 256, 8, seed=3)
    total, staleness = 10, 2
    rng = random.Random(40)  # kills and a stall, after a sync and inside an update
    plan = [(step, rng.choice(("kill", "stop")), rng.choice(("in_update", "after_sync")))
            for step in sorted(rng.sample(range(4, total), 3))]
    config = load_config(overrides=[
        "model.path=tiny:demo", f"data.train_files=[{train}]",
        "data.val_files=[]", "data.train_batch_size=16", "rollout.n=8",
        "rollout.prompt_length=256", "rollout.response_length=48", "rollout.max_num_seqs=256",
        "rollout.kv_cache_memory_bytes=67108864", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_assistant_turns=2", "rollout.multi_turn.tools=[calculator]",
        "rollout.multi_turn.max_tool_response_length=16", "actor.ppo_mini_batch_size=16",
        "actor.ppo_max_token_len_per_micro_batch=8192", "actor.optim.lr=1e-4",
        f"trainer.trainer_mode={mode}", f"trainer.total_steps={total}", "trainer.progress=false",
        f"trainer.async_rollout.max_staleness={staleness}", f"trainer.output_dir={tmp_path / 'run'}",
        "rollout.nnodes=1", "rollout.n_gpus_per_node=2", *FAULTS,
        f"rollout.fault_tolerance.max_restarts={len(plan)}"])
    run = Run(config)
    memory: dict[str, int] = {}

    async def main():
        await run.start()
        run.strike_at(plan, rng, timeout_s=180)

        async def measure(key: str):
            memory[key] = resident_bytes()

        run.after_sync[3] = lambda: measure("warm")
        fit = fit_separate_async if mode == "separate_async" else fit_colocate_async
        try:
            await fit(run.trainer)
            memory["end"] = resident_bytes()
            return run.trainer.step, await run.greedy_per_replica()
        finally:
            for pid in run.stopped:
                _continue(pid)
            await run.trainer.stop()

    step, greedy = asyncio.run(main())
    print("fault plan (step, fault, where):", plan, "memory:", memory)
    assert step == total
    for version, tokens, actor in greedy.values():
        assert version == total and tokens == actor
    run.check_whole()  # every session trained once, no token lost or generated twice
    assert len(run.batches) == total
    sessions = [entry for batch in run.batches for entry in batch]
    assert len(sessions) == total * 128
    assert all(stop != "aborted" for _, _, _, stop, _ in sessions)  # each one whole
    assert sum(turns > 2 for *_, turns in sessions) > len(sessions) // 4  # a tool call, then more
    for index, batch in enumerate(run.batches):  # update `index + 1` trains on version index
        assert all(index - oldest <= staleness for _, _, oldest, _, _ in batch), index
    records = records_of(tmp_path)
    assert records[-1]["fleet/restarts_total"] == len(plan)
    assert max(r["staleness/lag_max"] for r in records) <= staleness
    assert memory["end"] <= 1.1 * memory["warm"], memory
    for pid in run.stopped:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_past_max_restarts_the_run_fails_naming_the_server(tmp_path, ray_cluster):
    config = tiny_config(tmp_path, *QUICK, *FAULTS, "trainer.total_steps=6",
                         "rollout.fault_tolerance.max_restarts=0")
    run = Run(config)

    async def main():
        await run.start()
        replica = run.trainer.fleet.rollout.replicas["replica-0"]

        async def kill():
            ray_kill(replica.main_server)

        run.after_sync[1] = kill
        try:
            await fit_separate_async(run.trainer)
        finally:
            await run.trainer.stop()

    with pytest.raises(ServerRestartError, match=r"rollout server 'replica-0' died .* past "
                                                 r"rollout.fault_tolerance.max_restarts=0: the run "
                                                 r"stops. Raise max_restarts"):
        asyncio.run(asyncio.wait_for(main(), 240))


def test_the_pool_grows_when_the_trainer_waits_on_rollout(tmp_path, ray_cluster):
    """rollout.elastic.auto: the pool starts at min_replicas; with max_staleness=0 the trainer
    waits for every batch (idle/trainer_fraction above the low grow_above), so each sync adds
    one replica, synced before its first request, up to what the 3 rollout devices hold."""
    config = tiny_config(tmp_path, *QUICK, "trainer.total_steps=5",
                         "trainer.async_rollout.max_staleness=0", "rollout.nnodes=1",
                         "rollout.n_gpus_per_node=3", "rollout.elastic.auto.enable=true",
                         "rollout.elastic.auto.grow_above=0.01",
                         "rollout.elastic.auto.shrink_above=1")  # never shrinks
    run = Run(config)

    async def main():
        await run.start()
        run.spy_joins()
        try:
            await fit_separate_async(run.trainer)
            return run.trainer.step
        finally:
            await run.trainer.stop()

    assert asyncio.run(main()) == 5
    records = records_of(tmp_path)
    sizes = [int(r["fleet/replicas"]) for r in records]
    assert sizes[0] == 1 and sizes[-1] == 3  # from min_replicas to the devices' capacity
    for before, after, record in zip(sizes, sizes[1:], records):  # one more after a wait
        assert after == min(3, before + (record["idle/trainer_fraction"] > 0.01))
    assert [(sid, version, served) for sid, version, served, _ in run.joined] == [
        ("replica-1", sizes.index(2) + 1, sizes.index(2) + 1),
        ("replica-2", sizes.index(3) + 1, sizes.index(3) + 1)]
    assert all(requests == 0 for *_, requests in run.joined)  # synced before its first request
    run.check_whole()


def test_the_pool_grows_from_one_to_three_and_back_each_new_replica_on_the_version(
        tmp_path, ray_cluster):
    config = tiny_config(tmp_path, *QUICK, "trainer.total_steps=6",
                         "rollout.elastic.schedule=[[2,3],[4,1]]")
    run = Run(config)

    async def main():
        await run.start()
        run.spy_joins()
        try:
            await fit_separate_async(run.trainer)
            return run.trainer.step, sorted(run.trainer.fleet.rollout.replicas)
        finally:
            await run.trainer.stop()

    step, replicas = asyncio.run(main())
    assert step == 6 and replicas == ["replica-0"]
    assert [(sid, version, served) for sid, version, served, _ in run.joined] == [
        ("replica-1", 2, 2), ("replica-2", 2, 2)]
    assert all(requests == 0 for *_, requests in run.joined)  # synced before its first request
    run.check_whole()
    records = records_of(tmp_path)
    assert [r["fleet/replicas"] for r in records] == [1, 3, 3, 1, 1, 1]
    assert all("throughput/generated_tokens_per_second" in r for r in records)
    assert all(r["serving/retried_requests"] == 0 and r["serving/dead_servers"] == 0
               for r in records)


def ray_kill(server) -> None:
    import ray

    ray.kill(server, no_restart=True)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


SERVED = ["reward.placement=after_sampling", "reward.rule_weight=0", "reward.model.enable=true",
          "reward.model.path=tiny:reward", "rollout.multi_turn.enable=false",
          "rollout.multi_turn.tools=[]", "rollout.response_length=8", "data.val_files=[]",
          "trainer.total_steps=3"]


@pytest.mark.parametrize("restarts", [True, False])
def test_a_killed_reward_server_is_restarted_or_the_run_stops_clearly(tmp_path, ray_cluster,
                                                                      restarts):
    from tandem.fleet.served_rewards import ServedRewardLost
    from tandem.rewards.scorer import FAILED
    from tandem.trainer.sync import fit_sync

    config = tiny_config(tmp_path, *SERVED, *(FAULTS if restarts else []))
    trainer = RLTrainer(config)
    scored = []

    async def main():
        await trainer.start()
        rewards, sync, make_batch = trainer.fleet.rewards, trainer.fleet.sync_weights, trainer.make_batch

        async def sync_spy(version):
            metrics = await sync(version)
            if version == 1:  # between step 1 and step 2: the reward pool's only server dies
                ray_kill(rewards.reward_model.servers["reward-0"])
            return metrics

        def batch_spy(trajectories):
            scored.extend(dict(t.reward_extra) for t in trajectories)
            return make_batch(trajectories)

        trainer.fleet.sync_weights, trainer.make_batch = sync_spy, batch_spy
        try:
            await fit_sync(trainer)
            return trainer.step
        finally:
            await trainer.stop()

    if not restarts:
        with pytest.raises(ServedRewardLost, match=r"reward.model: no reward_model server is "
                                                   r"left \(reward-0 died\)"):
            asyncio.run(main())
        assert [r["step"] for r in records_of(tmp_path)] == [1]  # step 2 never trained
        return
    assert asyncio.run(main()) == 3
    assert len(scored) == 3 * 2 * 2 and not any(extra.get(FAILED) for extra in scored)
    records = records_of(tmp_path)
    assert records[-1]["fleet/restarts_total"] == 1
    assert records[-1]["serving/reward_model_dead_servers"] == 1
