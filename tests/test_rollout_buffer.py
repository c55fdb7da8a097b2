"""The async modes' rollout buffer: whole groups, back-pressure, the staleness bound (at
admission under on_stale=wait, by dropping under drop | regenerate)."""

import asyncio
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent.dataset import DatasetRow
from tandem.batch.trajectory import Trajectory
from tandem.trainer.admission import AdmissionSchedule
from tandem.trainer.rollout_buffer import (RolloutBuffer, RolloutGroup, StalenessError,
                                           check_staleness, default_capacity)


def trajectory(uid: str, session: int, low: int, high: int) -> Trajectory:
    return Trajectory(prompts=torch.tensor([1, 2]), responses=torch.tensor([3]),
                      response_mask=torch.tensor([1]), rollout_log_probs=torch.tensor([-0.5]),
                      min_global_steps=low, max_global_steps=high, uid=uid, session_id=session)


def group(uid: str, versions: list[tuple[int, int]], submitted: int = 0) -> RolloutGroup:
    return RolloutGroup(DatasetRow([{"role": "user", "content": uid}], uid=uid),
                        [trajectory(uid, s, low, high) for s, (low, high) in enumerate(versions)],
                        submitted)


def test_group_versions_cover_every_token():
    g = group("a", [(3, 4), (2, 5)])
    assert (g.min_version, g.max_version, g.lag(6), g.version_spread) == (2, 5, 4, 3)


def test_reserve_blocks_when_full_and_take_frees_slots():
    async def run():
        buffer = RolloutBuffer(2, max_staleness=0, on_stale="drop")
        await buffer.reserve()
        await buffer.reserve()
        third = asyncio.ensure_future(buffer.reserve())
        await asyncio.sleep(0.01)
        assert not third.done()  # back-pressure: two groups generating fill the buffer
        buffer.put(group("a", [(0, 0)]))
        await asyncio.sleep(0.01)
        assert not third.done()  # a finished group still holds its slot until taken
        taken, stale, metrics = await buffer.take(1, version=0)
        await asyncio.wait_for(third, 1.0)
        assert [g.row.uid for g in taken] == ["a"] and stale == []
        assert metrics["staleness/lag_max"] == 0 and metrics["buffer/depth"] == 1
        buffer.cancel(0, outcome="failed")
        assert buffer.in_flight == 2 - 1 and buffer.counts["failed"] == 1

    asyncio.run(run())


def test_take_waits_for_groups_and_refuses_impossible_counts():
    async def run():
        buffer = RolloutBuffer(3, max_staleness=1, on_stale="drop")
        with pytest.raises(ValueError, match="capacity"):
            await buffer.take(4, 0)
        for _ in range(2):
            await buffer.reserve()
        pending = asyncio.ensure_future(buffer.take(2, version=1))
        buffer.put(group("a", [(1, 1)]))
        await asyncio.sleep(0.01)
        assert not pending.done()
        buffer.put(group("b", [(0, 1)]))
        taken, _, metrics = await asyncio.wait_for(pending, 1.0)
        assert [g.row.uid for g in taken] == ["a", "b"]
        assert metrics["staleness/lag_0_fraction"] == 0.5 and metrics["staleness/lag_1_fraction"] == 0.5

    asyncio.run(run())


def test_stale_groups_are_dropped_or_handed_back():
    async def run(policy):
        buffer = RolloutBuffer(4, max_staleness=1, on_stale=policy)
        for uid, low in (("old", 0), ("new", 2), ("newer", 3)):
            await buffer.reserve()
            buffer.put(group(uid, [(low, 3)]))
        taken, stale, metrics = await buffer.take(2, version=3)
        return [g.row.uid for g in taken], [g.row.uid for g in stale], metrics, buffer.counts

    taken, stale, metrics, counts = asyncio.run(run("drop"))
    assert taken == ["new", "newer"] and stale == ["old"] and counts["dropped"] == 1
    assert metrics["staleness/stale_groups"] == 1 and metrics["staleness/lag_max"] == 1
    # token lags of the taken groups only (one policy token each, at versions 2 and 3)
    assert {k: v for k, v in metrics.items() if "token" in k} == {
        "staleness/token_lag_mean": 0.5, "staleness/token_lag_max": 1.0,
        "staleness/tokens_lag_0": 0.5, "staleness/tokens_lag_1": 0.5,
        "staleness/policy_tokens": 2.0}
    _, stale, _, counts = asyncio.run(run("regenerate"))
    assert stale == ["old"] and counts["regenerated"] == 1 and counts["dropped"] == 0
    with pytest.raises(ValueError, match="on_stale"):
        RolloutBuffer(1, on_stale="keep")


def test_check_staleness_names_the_trajectory():
    check_staleness([trajectory("u", 0, 4, 5)], version=5, max_staleness=1)
    with pytest.raises(StalenessError, match=r"u/1 has tokens of version 3, 2 behind"):
        check_staleness([trajectory("u", 1, 3, 5)], version=5, max_staleness=1)


def test_admission_holds_generation_within_the_bound():
    """B groups train per version: at head h at most (h + max_staleness + 1) x B groups, minus
    those trained or failed, may have started."""
    schedule = AdmissionSchedule(per_version=2, max_staleness=1)
    for _ in range(4):
        assert schedule.can_admit(0)
        schedule.admit(0)
    assert not schedule.can_admit(0)  # a fifth group of head 0 could not train by version 1
    schedule.release(0)  # one failed: its place is free again
    assert schedule.can_admit(0)
    schedule.admit(0)
    schedule.take(0), schedule.take(0)
    assert not schedule.can_admit(0) and schedule.can_admit(1)  # the next sync opens version 2
    with pytest.raises(ValueError, match="untaken"):
        AdmissionSchedule(2, 1).advance(1)


def test_wait_takes_the_group_about_to_expire_first_and_waits_for_it():
    async def run():
        buffer = RolloutBuffer(3, max_staleness=1, on_stale="wait", groups_per_version=1)
        assert [await buffer.reserve(), await buffer.reserve()] == [0, 0]  # "long", "short"
        third = asyncio.ensure_future(buffer.reserve())
        await asyncio.sleep(0.01)
        assert not third.done()  # a third group of head 0 could not train by version 1
        buffer.put(group("short", [(0, 0)]))
        taken, _, _ = await buffer.take(1, version=0)
        buffer.serving(1)  # the sync: head-1 groups may start
        assert await asyncio.wait_for(third, 1.0) == 1
        buffer.put(group("newer", [(1, 1)], submitted=1))
        pending = asyncio.ensure_future(buffer.take(1, version=1))
        await asyncio.sleep(0.01)
        assert not pending.done()  # "newer" is ready, but "long" expires after version 1
        buffer.put(group("long", [(0, 1), (0, 1)]))
        later, stale, metrics = await asyncio.wait_for(pending, 1.0)
        assert [g.row.uid for g in taken + later] == ["short", "long"] and stale == []
        assert metrics["staleness/lag_max"] == 1 and metrics["staleness/version_spread_max"] == 1
        assert buffer.counts["dropped"] == buffer.counts["regenerated"] == 0

    asyncio.run(run())


def test_wait_hands_a_breach_to_the_hard_check_instead_of_dropping_it():
    async def run():
        buffer = RolloutBuffer(2, max_staleness=0, on_stale="wait", groups_per_version=1, version=1)
        head = await buffer.reserve()
        # a server that a failed sync left behind: its tokens are older than the admitted head
        buffer.put(group("behind", [(head - 1, head)], submitted=head))
        return await buffer.take(1, version=1)

    taken, stale, _ = asyncio.run(run())
    assert [g.row.uid for g in taken] == ["behind"] and stale == []
    with pytest.raises(StalenessError, match="behind/0 has tokens of version 0, 1 behind"):
        check_staleness(taken[0].trajectories, 1, 0)


def test_default_capacity_never_exceeds_what_the_bound_can_train():
    assert default_capacity(4, 8) == 12 and default_capacity(4, 1) == 8 and default_capacity(4, 0) == 4


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 3), st.integers(1, 5), st.integers(0, 6),
       st.integers(0, 2**16))
def test_property_wait_trains_every_group_within_the_bound(max_staleness, per_version, steps,
                                                           extra_capacity, seed):
    """on_stale=wait with groups finishing and failing in random order: every admitted group is
    trained, failed, or still pending exactly once, none is dropped, no trained group's head is
    beyond the bound, and the trainer never waits on a group that is not generating."""
    capacity = per_version + extra_capacity  # beyond (max_staleness + 1) x B: admission binds
    rng = random.Random(seed)  # finish order, failures, versions spanned

    async def run():
        buffer = RolloutBuffer(capacity, max_staleness, "wait", per_version)
        generating: list[tuple[str, int]] = []
        admitted, trained, failed = [], [], []

        async def admit_all():
            while not buffer._slots.locked() and buffer.schedule.can_admit(buffer.served_version):
                head = await buffer.reserve()
                generating.append((f"g{len(admitted)}", head))
                admitted.append(generating[-1][0])

        for version in range(steps):
            take = asyncio.ensure_future(buffer.take(per_version, version))
            while True:
                await admit_all()
                await asyncio.sleep(0)
                if take.done():
                    break
                assert generating, "the trainer waits for a group that is not generating"
                uid, head = generating.pop(rng.randrange(len(generating)))
                if rng.random() < 0.1:
                    buffer.cancel(head, outcome="failed")
                    failed.append(uid)
                else:
                    newest = rng.randint(head, buffer.served_version)
                    buffer.put(group(uid, [(head, newest), (head, head)], submitted=head))
            taken, stale, _ = take.result()
            assert stale == [] and len(taken) == per_version
            check_staleness([t for g in taken for t in g.trajectories], version, max_staleness)
            trained += [g.row.uid for g in taken]
            buffer.serving(version + 1)
        ready = [g.row.uid for g in buffer._ready]
        pending = [uid for uid, _ in generating]
        return admitted, trained, failed, ready + pending, buffer

    admitted, trained, failed, left, buffer = asyncio.run(run())
    assert sorted(trained + failed + left) == sorted(admitted)
    assert len(set(trained + failed + left)) == len(admitted)
    assert buffer.counts["dropped"] == buffer.counts["regenerated"] == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.data())
def test_property_drop_no_group_over_the_bound_lost_or_duplicated(max_staleness, batch, data):
    """on_stale=drop, random arrival versions and sync points: every taken group is within the
    bound, and every put group is taken, stale, or still queued, exactly once."""
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=batch,
                                  max_size=12))

    async def run():
        buffer = RolloutBuffer(len(arrivals), max_staleness, on_stale="drop")
        for i, (low, span) in enumerate(arrivals):
            await buffer.reserve()
            buffer.put(group(f"g{i}", [(low, low + span), (low + span, low + span)]))
        seen: list[str] = []
        version = 0
        while buffer.depth >= batch:
            version += data.draw(st.integers(0, 2))  # syncs between updates
            try:
                taken, stale, _ = await asyncio.wait_for(
                    buffer.take(batch, version), 0.05)
            except asyncio.TimeoutError:
                break  # too few fresh groups left: take waits for more, as the trainer would
            for g in taken:
                assert g.lag(version) <= max_staleness
                check_staleness(g.trajectories, version, max_staleness)
            seen += [g.row.uid for g in taken + stale]
        return seen, buffer

    seen, buffer = asyncio.run(run())
    left = [g.row.uid for g in buffer._ready]
    assert len(seen) == len(set(seen))
    assert not set(seen) & set(left)
    assert buffer.counts["taken"] + buffer.counts["dropped"] + len(left) == len(arrivals)


async def test_the_producer_starts_no_group_beyond_the_bound():
    """The producer under the default policy: with batches of 2 and max_staleness 1 at most
    (1 + 1) x 2 groups of head 0 start; a sync opens the next version's groups."""
    from tandem.config.load import load_config
    from tandem.trainer.producer import RolloutProducer
    from tandem.trainer.rollout_buffer import make_buffer

    class Runner:
        def __init__(self) -> None:
            self.calls = 0

        async def run_prompt(self, row, seed=None):
            self.calls += 1
            return [trajectory(row.uid, 0, 0, 0)]

    class Trainer:
        def __init__(self, config) -> None:
            self.config, self.step, self.runner, self.prompt_batch = config, 0, Runner(), 0

        def next_prompt_batch(self):
            self.prompt_batch += 1
            return self.prompt_batch - 1

        def train_rows(self, step):
            return [DatasetRow([{"role": "user", "content": "?"}], uid=f"{step}-{i}")
                    for i in range(self.config.data.train_batch_size)]

        def seeds(self, step, count, validate):
            return list(range(count))

    config = load_config(overrides=["rollout.n=2", "rollout.agent_concurrency=32",
                                    "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                    "trainer.async_rollout.max_staleness=1",
                                    "trainer.async_rollout.buffer_groups=4"])
    trainer = Trainer(config)
    buffer = make_buffer(config.trainer.async_rollout, 2, version=0)
    producer = RolloutProducer(trainer, buffer)
    producer.start()
    for _ in range(200):
        await asyncio.sleep(0)
    assert trainer.runner.calls == 4 and buffer.depth == 4  # held by the bound, none dropped
    taken, _, _ = await buffer.take(2, version=0)
    for _ in range(200):
        await asyncio.sleep(0)
    assert trainer.runner.calls == 4  # slots are free, but head-0 groups could not train in time
    buffer.serving(1)
    for _ in range(200):
        await asyncio.sleep(0)
    assert trainer.runner.calls == 6 and {g.admitted_version for g in buffer._ready} == {0, 1}
    await producer.stop()
