"""The async modes' rollout buffer: whole groups, back-pressure, the staleness bound."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent.dataset import DatasetRow
from tandem.batch.trajectory import Trajectory
from tandem.trainer.rollout_buffer import (RolloutBuffer, RolloutGroup, StalenessError,
                                           check_staleness)


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
    assert (g.min_version, g.max_version, g.lag(6)) == (2, 5, 4)


def test_reserve_blocks_when_full_and_take_frees_slots():
    async def run():
        buffer = RolloutBuffer(2)
        await buffer.reserve()
        await buffer.reserve()
        third = asyncio.ensure_future(buffer.reserve())
        await asyncio.sleep(0.01)
        assert not third.done()  # back-pressure: two groups generating fill the buffer
        buffer.put(group("a", [(0, 0)]))
        await asyncio.sleep(0.01)
        assert not third.done()  # a finished group still holds its slot until taken
        taken, stale, metrics = await buffer.take(1, version=0, max_staleness=0)
        await asyncio.wait_for(third, 1.0)
        assert [g.row.uid for g in taken] == ["a"] and stale == []
        assert metrics["staleness/lag_max"] == 0 and metrics["buffer/depth"] == 1
        buffer.cancel(failed=True)
        assert buffer.in_flight == 2 - 1 and buffer.counts["failed"] == 1

    asyncio.run(run())


def test_take_waits_for_groups_and_refuses_impossible_counts():
    async def run():
        buffer = RolloutBuffer(3)
        with pytest.raises(ValueError, match="capacity"):
            await buffer.take(4, 0, 0)
        for _ in range(2):
            await buffer.reserve()
        pending = asyncio.ensure_future(buffer.take(2, version=1, max_staleness=1))
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
        buffer = RolloutBuffer(4)
        for uid, low in (("old", 0), ("new", 2), ("newer", 3)):
            await buffer.reserve()
            buffer.put(group(uid, [(low, 3)]))
        taken, stale, metrics = await buffer.take(2, version=3, max_staleness=1, on_stale=policy)
        return [g.row.uid for g in taken], [g.row.uid for g in stale], metrics, buffer.counts

    taken, stale, metrics, counts = asyncio.run(run("drop"))
    assert taken == ["new", "newer"] and stale == ["old"] and counts["dropped"] == 1
    assert metrics["staleness/stale_groups"] == 1 and metrics["staleness/lag_max"] == 1
    # token lags of the taken groups only (one policy token each, at versions 2 and 3)
    assert {k: v for k, v in metrics.items() if "token" in k} == {
        "staleness/token_lag_mean": 0.5, "staleness/token_lag_max": 1.0,
        "staleness/tokens_lag_0": 0.5, "staleness/tokens_lag_1": 0.5}
    _, stale, _, counts = asyncio.run(run("regenerate"))
    assert stale == ["old"] and counts["regenerated"] == 1 and counts["dropped"] == 0
    with pytest.raises(ValueError, match="on_stale"):
        asyncio.run(RolloutBuffer(1).take(1, 0, 0, on_stale="keep"))


def test_check_staleness_names_the_trajectory():
    check_staleness([trajectory("u", 0, 4, 5)], version=5, max_staleness=1)
    with pytest.raises(StalenessError, match=r"u/1 has tokens of version 3, 2 behind"):
        check_staleness([trajectory("u", 1, 3, 5)], version=5, max_staleness=1)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.data())
def test_property_no_group_over_the_bound_lost_or_duplicated(max_staleness, batch, data):
    """Random arrival versions and sync points: every taken group is within the bound, and every
    put group is taken, stale, or still queued, exactly once."""
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=batch,
                                  max_size=12))

    async def run():
        buffer = RolloutBuffer(len(arrivals))
        for i, (low, span) in enumerate(arrivals):
            await buffer.reserve()
            buffer.put(group(f"g{i}", [(low, low + span), (low + span, low + span)]))
        seen: list[str] = []
        version = 0
        while buffer.depth >= batch:
            version += data.draw(st.integers(0, 2))  # syncs between updates
            try:
                taken, stale, _ = await asyncio.wait_for(
                    buffer.take(batch, version, max_staleness), 0.05)
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
