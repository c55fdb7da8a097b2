"""trainer_mode=colocate_async end to end on a tiny model: background generation, abort ->
sleep -> train -> sync -> resume, the staleness bound, partial rollouts across syncs."""

import asyncio
from collections import defaultdict

from test_trainer_sync import engine_and_actor_greedy, tiny_config

from tandem.trainer.colocate_async import fit_colocate_async
from tandem.trainer.metrics import read_metrics
from tandem.trainer.rl_trainer import RLTrainer
from tandem.types import GenerateRequest


class CountingClient:
    """Wraps the server client under the resumable one: tokens returned per request id."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        output = await self.inner.generate(GenerateRequest(request_id, prompt_ids, sampling_params))
        self.tokens[request_id] += len(output.token_ids)
        self.calls[request_id] += 1
        return output


def policy_versions(trajectory):
    """The distinct weight versions of a trajectory's policy tokens, sorted."""
    return sorted(set(trajectory.response_versions[trajectory.response_mask.bool()].tolist()))


def test_colocate_async_trains_within_the_staleness_bound(tmp_path, ray_cluster):
    config = tiny_config(tmp_path, "trainer.trainer_mode=colocate_async", "trainer.total_steps=3",
                         "trainer.async_rollout.max_staleness=1",
                         # one sequence at a time: when a batch is complete the next sequence
                         # has just started, and the update's abort reaches it a few tokens in
                         "rollout.response_length=64", "rollout.max_num_seqs=1",
                         "rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]")
    consumed = []

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        counter = CountingClient(trainer.runner.loop.client.client)
        trainer.runner.loop.client.client = counter
        original = trainer.make_batch

        def spy(trajectories):  # called once per update, with the update's trajectories
            for t in trajectories:  # per-token versions: in order, inside the trajectory's bounds
                policy = t.response_versions[t.response_mask.bool()].tolist()
                assert policy == sorted(policy) and len(t.response_versions) == len(t.responses)
                assert t.min_global_steps <= policy[0] and policy[-1] <= t.max_global_steps
            consumed.append([(t.uid, t.session_id, t.min_global_steps, t.max_global_steps,
                              int(t.response_mask.sum()), t.stop_reason, policy_versions(t))
                             for t in trajectories])
            return original(trajectories)

        trainer.make_batch = spy
        try:
            await fit_colocate_async(trainer)
            rows = trainer.train_rows(0)
            prompts = [trainer.runner.loop.chat_format.prompt_ids(row.messages) for row in rows]
            checks = await engine_and_actor_greedy(trainer, prompts)
            stats = await trainer.fleet.rollout.stats()
            return trainer.step, checks, counter, stats
        finally:
            await trainer.stop()

    step, checks, counter, stats = asyncio.run(run())
    assert step == 3 and len(consumed) == 3
    # the engine serves the actor's latest weights once generation is quiet
    for engine_tokens, actor_tokens in checks:
        assert engine_tokens == actor_tokens
    # every update: 2 whole groups of n=2, none reused, none older than the bound
    keys = [(uid, session) for batch in consumed for uid, session, *_ in batch]
    assert len(keys) == len(set(keys)) == 3 * 2 * 2
    for version, batch in enumerate(consumed):
        assert all(version - low <= 1 for _, _, low, *_ in batch)
        # per-token versions: the head (oldest policy token) is within the bound too
        assert all(version - versions[0] <= 1 for *_, versions in batch)
        assert all(stop != "aborted" for *_, stop, _ in batch)
        by_uid = defaultdict(list)
        for uid, session, *_ in batch:
            by_uid[uid].append(session)
        assert all(sorted(s) == [0, 1] for s in by_uid.values())
        # no token generated twice: what the servers returned for a session is what it holds
        for uid, session, _, _, sampled, _, _ in batch:
            assert counter.tokens[f"{uid}-{session}"] == sampled <= 64
    # some trajectory was interrupted by an update and resumed: its tokens carry two versions
    assert any(len(versions) == 2 for batch in consumed for *_, versions in batch)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/update" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["staleness/lag_max"] <= 1 and record["weight_version"] == record["step"]
        assert record["staleness/token_lag_max"] <= record["staleness/lag_max"]
        assert abs(sum(v for k, v in record.items() if k.startswith("staleness/tokens_lag_"))
                   - 1.0) < 1e-9
        assert record["staleness/dropped_total"] == record["staleness/stale_groups"] == 0  # wait
        assert record["staleness/version_spread_max"] <= 1
        for key in ("buffer/wait_seconds", "buffer/depth", "time/abort", "time/resume",
                    "rollout/cross_version_fraction", "actor/grad_norm"):
            assert key in record, key
    assert sum(s["tokens"] for s in stats.values()) >= sum(counter.tokens.values())
