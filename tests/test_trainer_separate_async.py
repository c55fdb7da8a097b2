"""trainer_mode=separate_async end to end on a tiny model: a standalone rollout server on a
device of its own generates while the hybrid worker trains; parameter_sync_step mini-batches
per step, then a cross-process (shm) weight sync; the staleness bound; partial rollouts."""

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import pytest
from test_trainer_colocate_async import CountingClient, policy_versions
from test_trainer_sync import tiny_config

from tandem.config.load import ConfigError, load_config
from tandem.trainer import separate_async
from tandem.trainer.metrics import read_metrics
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.separate_async import fit_separate_async
from tandem.fleet.spillover import Spillover
from tandem.trainer.step_metrics import merge_mini_batch_metrics
from tandem.types import GenerateRequest


def test_one_override_derives_rollout_devices_engine_and_sync_step():
    config = load_config(overrides=["trainer.trainer_mode=separate_async", "trainer.n_devices=2",
                                    "actor.fsdp_size=2", "data.train_batch_size=8",
                                    "actor.ppo_mini_batch_size=2"])
    assert (config.rollout.nnodes, config.rollout.n_gpus_per_node) == (1, 2)
    assert config.rollout.checkpoint_engine.backend == "auto"  # resolved at start (fleet.weight_sync)
    assert config.trainer.separate_async.parameter_sync_step == 4
    # what the user sets is kept, and still validated
    config = load_config(overrides=["trainer.trainer_mode=separate_async", "rollout.nnodes=1",
                                    "rollout.n_gpus_per_node=3",
                                    "rollout.checkpoint_engine.backend=gloo"])
    assert (config.rollout.nnodes, config.rollout.n_gpus_per_node) == (1, 3)
    assert config.rollout.checkpoint_engine.backend == "gloo"
    with pytest.raises(ConfigError, match=r"data.train_batch_size.*parameter_sync_step \(3\)"):
        load_config(overrides=["trainer.trainer_mode=separate_async", "data.train_batch_size=8",
                               "actor.ppo_mini_batch_size=2",
                               "trainer.separate_async.parameter_sync_step=3"])
    # sync mode derives nothing
    assert load_config(overrides=[]).rollout.checkpoint_engine.backend == "auto"


@pytest.mark.parametrize("path", ["examples/arithmetic.yaml", "src/tandem/demo/demo.yaml"])
@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_example_configs_load_in_every_mode_with_one_override(path, mode):
    root = Path(__file__).resolve().parents[1]
    config = load_config(root / path, [f"trainer.trainer_mode={mode}"])
    assert config.trainer.trainer_mode == mode
    if mode == "separate_async":  # 8 prompts per step, mini-batches of 8: one update per sync
        assert config.trainer.separate_async.parameter_sync_step == 1
        assert config.rollout.nnodes * config.rollout.n_gpus_per_node == 1


def test_merge_mini_batch_metrics_means_maxima_and_sums():
    parts = [{"actor/pg_loss": 1.0, "staleness/lag_max": 0.0, "buffer/wait_seconds": 2.0,
              "staleness/dropped_total": 1.0, "staleness/regenerated_total": 0.0},
             {"actor/pg_loss": 3.0, "staleness/lag_max": 1.0, "buffer/wait_seconds": 0.5,
              "staleness/dropped_total": 3.0, "staleness/regenerated_total": 0.0}]
    merged = merge_mini_batch_metrics(parts)
    assert merged == {"actor/pg_loss": 2.0, "staleness/lag_max": 1.0,
                      "buffer/wait_seconds": 2.5, "staleness/dropped_total": 3.0,
                      "staleness/regenerated_total": 0.0}


class RecordingSpillover(Spillover):
    """Spillover that records, after each leave, its servers' counters and the balancer's loads."""

    made: list["RecordingSpillover"] = []

    def __init__(self, *args):
        super().__init__(*args)
        self.leaves = []  # (spilled_tokens so far, [server stats], {server_id: in flight})
        RecordingSpillover.made.append(self)

    async def leave(self):
        joined = self.joined
        await super().leave()
        if joined:
            servers = [server for servers in await self._control("stats") for server in servers]
            loads = (await self.fleet.rollout.status()).in_flight()
            self.leaves.append((self.spilled_tokens, servers, loads))


@pytest.mark.parametrize("spillover", [False, True])
def test_separate_async_trains_while_standalone_rollout_generates(tmp_path, ray_cluster, spillover,
                                                                  monkeypatch):
    # train_batch_size=2, ppo_mini_batch_size=1: parameter_sync_step is derived as 2
    config = tiny_config(tmp_path, "trainer.trainer_mode=separate_async", "trainer.total_steps=3",
                         f"trainer.separate_async.spillover={str(spillover).lower()}",
                         "trainer.async_rollout.max_staleness=1",
                         # one sequence at a time, long answers: groups are still generating
                         # when a sync comes, so some trajectory spans two versions
                         "rollout.response_length=256", "rollout.max_num_seqs=1",
                         "rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]",
                         # a gradient at every update even when a group's rewards tie
                         "actor.entropy_coeff=0.01")
    assert config.trainer.separate_async.parameter_sync_step == 2
    consumed, after_sync = [], []
    returned = defaultdict(int)  # (server_id, request id) -> tokens that server returned
    RecordingSpillover.made.clear()
    monkeypatch.setattr(separate_async, "Spillover", RecordingSpillover)

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        assert trainer.fleet.rollout.layout.value == "standalone"
        assert trainer.fleet.transport == "shm"  # auto: every server on the sender's host
        counter = CountingClient(trainer.runner.loop.client.client)
        trainer.runner.loop.client.client = counter
        generate_on = counter.inner._generate_on

        async def generate_on_spy(server_id, request):  # which server returned which tokens
            output = await generate_on(server_id, request)
            returned[server_id, request.request_id] += len(output.token_ids)
            return output

        counter.inner._generate_on = generate_on_spy
        rows = trainer.train_rows(0)
        prompts = [trainer.runner.loop.chat_format.prompt_ids(row.messages) for row in rows]
        original_batch, original_sync = trainer.make_batch, trainer.fleet.sync_weights

        def batch_spy(trajectories):  # once per mini-batch update, with its trajectories
            consumed.append((trainer.step, [(t.uid, t.session_id, t.min_global_steps,
                                             int(t.response_mask.sum()), t.stop_reason,
                                             policy_versions(t)) for t in trajectories]))
            return original_batch(trajectories)

        async def sync_spy(version):
            # a sync while a request generates: it is interrupted and resumes on the new
            # version (waiting here, up to 10 s, keeps that from depending on timing: a step
            # may end between two requests, and an answer can end at eos early)
            deadline = time.monotonic() + 10
            while (trainer.step and time.monotonic() < deadline
                   and not sum((await trainer.fleet.rollout.status()).in_flight().values())):
                await asyncio.sleep(0.01)
            metrics = await original_sync(version)
            # the trainer waits here: the actor is exactly the version just synced
            versions = await trainer.fleet.rollout.weight_versions()
            client = trainer.fleet.rollout.client()
            pairs = []
            for index, prompt in enumerate(prompts):
                output = await client.generate(GenerateRequest(f"check-{trainer.step}-{index}", prompt,
                                               {"temperature": 0.0, "max_tokens": 8,
                                                "logprobs": True}))
                actor = await trainer.workers[0].actor_greedy.remote(prompt, len(output.token_ids))
                pairs.append((output.token_ids, actor, output.log_probs))
            after_sync.append((trainer.step, versions, pairs))
            return metrics

        trainer.make_batch, trainer.fleet.sync_weights = batch_spy, sync_spy
        try:
            await fit_separate_async(trainer)
            return trainer.step, counter, await trainer.fleet.rollout.stats()
        finally:
            await trainer.stop()

    step, counter, stats = asyncio.run(run())
    assert step == 3
    # 3 steps x parameter_sync_step 2 mini-batches of 1 whole group (n=2), at versions 0, 0, 1, 1, 2, 2
    assert [version for version, _ in consumed] == [0, 0, 1, 1, 2, 2]
    # initial sync + one per step; each time the server serves the actor's version and weights
    assert [version for version, _, _ in after_sync] == [0, 1, 2, 3]
    for version, served, pairs in after_sync:
        assert served == {"replica-0": version}
        for engine_tokens, actor_tokens, _ in pairs:
            assert engine_tokens == actor_tokens
    # the engine's weights changed at every sync: its greedy log-probs differ between syncs
    logprobs = [[tuple(p[2]) for p in pairs] for _, _, pairs in after_sync]
    assert all(a != b for a, b in zip(logprobs, logprobs[1:]))
    keys = [(uid, session) for _, batch in consumed for uid, session, *_ in batch]
    assert len(keys) == len(set(keys)) == 3 * 2 * 2  # none lost from a batch, none reused
    for version, batch in consumed:
        assert all(version - low <= 1 for _, _, low, *_ in batch)
        # per-token versions: the head (oldest policy token) is within the bound too
        assert all(version - versions[0] <= 1 for *_, versions in batch)
        assert all(stop != "aborted" for *_, stop, _ in batch)
        by_uid = defaultdict(list)
        for uid, session, *_ in batch:
            by_uid[uid].append(session)
        assert all(sorted(s) == [0, 1] for s in by_uid.values())
        # no token generated twice, budgets respected across the aborts of the syncs
        for uid, session, _, sampled, _, _ in batch:
            assert counter.tokens[f"{uid}-{session}"] == sampled <= 256
    # a trajectory a sync interrupted resumed on the next version (whether one was generating
    # at a sync depends on timing here; test_token_versions.py interrupts one on purpose)
    for _, batch in consumed:
        for *_, versions in batch:
            assert len(versions) <= 2 and all(b == a + 1 for a, b in zip(versions, versions[1:]))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/update" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["staleness/lag_max"] <= 1 and record["weight_version"] == record["step"]
        assert 0 <= record["idle/trainer_fraction"] <= 1 and 0 <= record["idle/rollout_fraction"] <= 1
        # spillover: the buffer is empty before the first step, so the training engine joins
        assert ("spill/joins_total" in record) == spillover
        if spillover:
            assert record["spill/joins_total"] >= 1 and record["spill/tokens"] >= 0
        for key in ("sync/total_s", "sync/transfer_s", "sync/pause_s", "idle/trainer_seconds",
                    "idle/rollout_seconds", "buffer/wait_seconds", "actor/grad_norm",
                    "rollout/cross_version_fraction"):
            assert key in record, key
    spilled = sum(spill.spilled_tokens for spill in RecordingSpillover.made)
    assert sum(s["tokens"] for s in stats.values()) + spilled >= sum(counter.tokens.values())
    if spillover:
        spill_tokens_are_the_engines_and_the_trajectories(records, consumed, returned)


def spill_tokens_are_the_engines_and_the_trajectories(records, consumed, returned):
    """The training workers' engines generated during a step, as counted by the engines
    themselves, by what the client got back from them, and by the trajectories trained on."""
    (spill,) = RecordingSpillover.made
    assert len(spill.leaves) == spill.joins == records[-1]["spill/joins_total"] >= 1
    # joined before the first groups started: they spread over the spill engines
    assert records[0]["spill/tokens"] > 0
    by_server = defaultdict(int)
    for (server_id, _), tokens in returned.items():
        by_server[server_id] += tokens
    spilled = sum(tokens for server_id, tokens in by_server.items() if server_id.startswith("spill-"))
    # the metric is the engines' own count, and it is exactly what came back from them
    assert sum(r["spill/tokens"] for r in records) == spill.spilled_tokens == spilled > 0
    for spilled_so_far, servers, loads in spill.leaves:  # each left cleanly
        assert sum(server["tokens"] for server in servers) == spilled_so_far
        # every token the engine generated came back to a caller (aborted ones included)
        assert sum(server["backend"]["generated_tokens"] for server in servers) == spilled_so_far
        assert all(server["generating"] == 0 and server["asleep"] == ["kv_cache", "weights"]
                   for server in servers)
        assert not any(server_id.startswith("spill-") for server_id in loads)
    # trajectories trained on hold tokens the spill engines sampled, counted once
    trained = [f"{uid}-{session}" for _, batch in consumed for uid, session, *_ in batch]
    from_spill = sum(returned[server_id, key] for key in trained for server_id in by_server
                     if server_id.startswith("spill-"))
    assert 0 < from_spill <= spilled
    # training went on after the last leave: every step's updates ran
    assert [version for version, _ in consumed] == [0, 0, 1, 1, 2, 2]
