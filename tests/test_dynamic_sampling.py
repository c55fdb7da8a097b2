"""Dynamic sampling (algorithm.filter_groups): the filter by hand, the sync mode's extra prompt
batches, the async producer dropping zero-variance groups with the buffer's guarantees intact
(none lost or duplicated, staleness bounded), and the load-time refusals."""

import asyncio
import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent.dataset import DatasetRow
from tandem.agent.runner import AllSessionsFailed
from tandem.algorithms import groups_with_signal
from tandem.batch.trajectory import Trajectory
from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.trainer.dynamic_sampling import GroupFilter, NoGroupKept, fill_batch
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rollout_buffer import check_staleness, make_buffer


def test_groups_with_signal_by_hand():
    values = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0]
    ids = ["a", "a", "b", "b", "c", "c", "d"]
    assert groups_with_signal(values, ids) == {"b"}  # c ties, d is a group of one
    assert groups_with_signal([], []) == set()
    with pytest.raises(ValueError, match="3 values for 2 group ids"):
        groups_with_signal([1, 2, 3], ["a", "b"])


def sample(uid, session, reward, **extra):
    return Trajectory(prompts=torch.tensor([1, 2]), responses=torch.tensor([3]),
                      response_mask=torch.tensor([1]), rollout_log_probs=torch.tensor([-0.5]),
                      min_global_steps=0, max_global_steps=0, uid=uid, session_id=session,
                      reward=reward, reward_extra=extra)


def test_the_filter_keeps_varying_groups_by_reward_or_by_a_detail():
    samples = [sample("a", 0, 1.0, acc=1.0), sample("a", 1, 0.5, acc=1.0),
               sample("b", 0, 0.0, acc=0.0), sample("b", 1, 0.0, reward_failed=1.0),
               sample("c", 0, 1.0, acc=1.0), sample("c", 1, 0.0, acc=0.0)]
    kept, dropped = GroupFilter("reward").split(samples)
    assert [[t.uid for t in g] for g in kept] == [["a", "a"], ["c", "c"]] and dropped == 1
    kept, dropped = GroupFilter("acc").split(samples)  # a failed score counts as acc 0
    assert [g[0].uid for g in kept] == ["c"] and dropped == 2
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.metric: is 'pass'.*a/0 "
                                         r"no such detail \(it gave \['acc'\]\)"):
        GroupFilter("pass").split(samples)
    samples[0].reward_extra["verdict"] = "yes"  # a text detail is no metric to filter on
    with pytest.raises(ValueError, match=r"metric: is 'verdict', but the reward gave sample "
                                         r"a/0 verdict='yes', no finite number"):
        GroupFilter("verdict").split(samples)


def test_the_config_is_refused_where_it_cannot_be_honoured():
    config = load_config(overrides=[])
    assert (config.algorithm.filter_groups.enable, config.algorithm.filter_groups.metric,
            config.algorithm.filter_groups.max_gen_batches) == (False, "reward", 10)
    gae = ["rollout.n=1", "algorithm.adv_estimator=gae", "critic.enable=true"]
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.enable: rollout\.n=1.*"
                                          r"set rollout\.n >= 2"):
        load_config(overrides=[*gae, "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match=r"metric: is 'seq_reward'.*metric=reward"):
        load_config(overrides=["rollout.n=2", "algorithm.filter_groups.enable=true",
                               "algorithm.filter_groups.metric=seq_reward"])
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.max_gen_batches"):
        load_config(overrides=["rollout.n=2", "algorithm.filter_groups.max_gen_batches=0"])
    load_config(overrides=gae)  # off: n=1 is fine


def half_solved(uid: str, session: int) -> float:
    """Prompt k of a batch: solved by every session when k is even, else by every other one."""
    return 1.0 if int(uid.split("-")[1]) % 2 == 0 else float(session % 2)


class FakeTrainer:
    """What fill_batch and the producer use of RLTrainer: prompt batches, generation, rewards."""

    def __init__(self, *overrides, reward=half_solved):
        self.config = load_config(overrides=["rollout.n=2", "data.train_batch_size=4",
                                             "actor.ppo_mini_batch_size=4",
                                             "algorithm.filter_groups.enable=true", *overrides])
        self.step, self.prompt_batch, self.reward = 0, 0, reward
        self.drawn: list[int] = []

    def next_prompt_batch(self):
        self.prompt_batch += 1
        return self.prompt_batch - 1

    def train_rows(self, index):
        self.drawn.append(index)
        return [DatasetRow([{"role": "user", "content": "?"}], uid=f"{index}-{i}")
                for i in range(self.config.data.train_batch_size)]

    async def generate(self, rows, index):
        return [sample(row.uid, s, None) for row in rows for s in range(self.config.rollout.n)]

    async def compute_rewards(self, trajectories):
        for t in trajectories:
            if t.reward is None:
                t.reward = self.reward(t.uid, t.session_id)


def test_sync_fills_the_batch_from_extra_prompt_batches():
    trainer = FakeTrainer()
    trajectories, metrics = asyncio.run(fill_batch(trainer))
    by_group = {}
    for t in trajectories:
        by_group.setdefault(t.uid, []).append(t.reward)
    assert len(by_group) == 4 and all(len(set(r)) > 1 for r in by_group.values())
    assert list(by_group) == ["0-1", "0-3", "1-1", "1-3"] and trainer.drawn == [0, 1]
    assert metrics == {"filter/groups_kept": 4.0, "filter/groups_dropped": 4.0,
                       "filter/gen_batches": 2.0}
    asyncio.run(fill_batch(trainer))
    assert trainer.drawn == [0, 1, 2, 3]  # the next step draws on from the cursor


def test_sync_trains_on_what_there_is_when_the_budget_is_spent(caplog):
    trainer = FakeTrainer("algorithm.filter_groups.max_gen_batches=1")
    with caplog.at_level(logging.WARNING):
        trajectories, metrics = asyncio.run(fill_batch(trainer))
    assert len({t.uid for t in trajectories}) == 2 and metrics["filter/groups_kept"] == 2
    assert metrics["filter/gen_batches"] == 1 and "kept 2 of 4 groups" in caplog.text
    solved = FakeTrainer("algorithm.filter_groups.max_gen_batches=3", reward=lambda uid, s: 1.0)
    with pytest.raises(NoGroupKept, match="all 12 groups of 3 prompt batch"):
        asyncio.run(fill_batch(solved))


def test_sync_a_batch_whose_sessions_all_fail_adds_nothing():
    trainer = FakeTrainer()
    generate = trainer.generate

    async def first_fails(rows, index):
        if index == 0:
            raise AllSessionsFailed("all 8 sessions failed", [])
        return await generate(rows, index)

    trainer.generate = first_fails
    trajectories, metrics = asyncio.run(fill_batch(trainer))
    assert metrics["filter/gen_batches"] == 3 and metrics["filter/groups_kept"] == 4
    trainer = FakeTrainer("algorithm.filter_groups.max_gen_batches=2")
    trainer.generate = lambda rows, index: first_fails(rows, 0)
    with pytest.raises(AllSessionsFailed):
        asyncio.run(fill_batch(trainer))


class ScriptedRunner:
    """run_prompt waits until the test finishes the group (random order); 10% fail."""

    def __init__(self, trainer, buffer, rng):
        self.trainer, self.buffer, self.rng = trainer, buffer, rng
        self.generating: list[tuple[str, asyncio.Future]] = []
        self.started: list[str] = []

    async def run_prompt(self, row, seed=None):
        head = self.buffer.served_version
        self.started.append(row.uid)
        done = asyncio.get_running_loop().create_future()
        self.generating.append((row.uid, done))
        newest = await done
        if newest is None:
            raise RuntimeError("this prompt failed")
        return [Trajectory(prompts=torch.tensor([1]), responses=torch.tensor([3]),
                           response_mask=torch.tensor([1]), rollout_log_probs=torch.tensor([-0.5]),
                           min_global_steps=head, max_global_steps=max(head, newest),
                           uid=row.uid, session_id=s) for s in range(2)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2),
       st.integers(0, 2**16))
def test_property_filtering_producer_loses_and_duplicates_nothing_within_the_bound(
        max_staleness, per_version, steps, extra_batches, seed):
    """The producer with filter_groups on and the buffer under on_stale=wait: every started
    group is trained, filtered, failed or still pending exactly once; only groups with signal
    train; every step is full; no trained group is beyond the bound."""
    rng = random.Random(seed)

    async def run():
        trainer = FakeTrainer(f"data.train_batch_size={per_version}",
                              f"actor.ppo_mini_batch_size={per_version}",
                              f"trainer.async_rollout.max_staleness={max_staleness}",
                              f"trainer.async_rollout.buffer_groups="
                              f"{per_version * (1 + min(extra_batches, max_staleness))}",
                              "rollout.agent_concurrency=64",
                              "algorithm.filter_groups.max_gen_batches=1000",
                              reward=lambda uid, s: 1.0 if solved[uid] else float(s))
        solved: dict[str, bool] = {}
        buffer = make_buffer(trainer.config.trainer.async_rollout, per_version, version=0)
        runner = ScriptedRunner(trainer, buffer, rng)
        trainer.runner = runner
        trainer.seeds = lambda index, count, validate: list(range(count))
        producer = RolloutProducer(trainer, buffer)
        producer.start()
        trained, failed, metrics = [], [], []
        try:
            for version in range(steps):
                take = asyncio.ensure_future(buffer.take(per_version, version))
                while True:
                    for _ in range(5):
                        await asyncio.sleep(0)
                    if take.done():
                        break
                    assert runner.generating, "the trainer waits for a group that is not generating"
                    uid, done = runner.generating.pop(rng.randrange(len(runner.generating)))
                    solved[uid] = rng.random() < 0.5
                    if rng.random() < 0.1:
                        failed.append(uid)
                        done.set_result(None)
                    else:
                        done.set_result(rng.randint(0, buffer.served_version))
                taken, stale, _ = take.result()
                assert stale == [] and len(taken) == per_version
                check_staleness([t for g in taken for t in g.trajectories], version, max_staleness)
                assert all(not solved[g.row.uid] for g in taken)  # only groups with signal
                trained += [g.row.uid for g in taken]
                metrics.append(producer.filter_metrics(len(taken)))
                buffer.serving(version + 1)
        finally:
            await producer.stop()
        filtered = [uid for uid in runner.started
                    if uid in solved and solved[uid] and uid not in failed]
        left = [g.row.uid for g in buffer._ready] + [uid for uid, _ in runner.generating]
        return runner.started, trained, failed, filtered, left, buffer, metrics

    started, trained, failed, filtered, left, buffer, metrics = asyncio.run(run())
    assert sorted(trained + failed + filtered + left) == sorted(started)
    assert len(set(trained + failed + filtered + left)) == len(started)
    assert buffer.counts["filtered"] == len(filtered) and buffer.counts["taken"] == len(trained)
    assert sum(m["filter/groups_dropped"] for m in metrics) <= len(filtered)
    assert all(m["filter/groups_kept"] == per_version for m in metrics)


async def test_the_producer_stops_the_run_when_the_budget_goes_on_solved_groups():
    trainer = FakeTrainer("data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                          "algorithm.filter_groups.max_gen_batches=2",
                          reward=lambda uid, s: 1.0)

    class Runner:
        async def run_prompt(self, row, seed=None):
            return [sample(row.uid, s, None) for s in range(2)]

    trainer.runner = Runner()
    trainer.seeds = lambda index, count, validate: list(range(count))
    buffer = make_buffer(trainer.config.trainer.async_rollout, 2, version=0)
    producer = RolloutProducer(trainer, buffer)
    producer.start()
    try:
        with pytest.raises(NoGroupKept, match="dropped 4 groups in a row"):
            await asyncio.wait_for(buffer.take(2, 0), 5.0)
    finally:
        await producer.stop()
    assert buffer.counts["filtered"] >= 4 and buffer.counts["taken"] == 0
