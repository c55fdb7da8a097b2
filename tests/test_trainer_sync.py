"""The sync-mode RL loop end to end on a tiny model (Ray workers, native engine, tool loop)."""

import asyncio

import pytest
import ray

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets, write_jsonl
from tandem.rewards import RewardResult, register_reward


@register_reward("test_parity")
def parity_reward(response_text, ground_truth, extra_info):
    """A reward with variance even for a random model: 1 when the reply has an even length."""
    return RewardResult(float(len(response_text) % 2 == 0), {"acc": float(len(response_text) % 2 == 0)})
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.sync import fit_sync
from tandem.types import GenerateRequest


def tiny_config(tmp_path, *extra):
    train, val = make_datasets(tmp_path / "data", 8, 3, seed=0)
    rows = [line for line in train.read_text().splitlines()]
    import json

    write_jsonl([{**json.loads(row), "data_source": "test_parity"} for row in rows], train)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.train_batch_size=2", "rollout.n=2", "rollout.prompt_length=320",
        "rollout.response_length=12", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_tool_response_length=8",
        "rollout.kv_cache_memory_bytes=16777216", "actor.ppo_mini_batch_size=1",
        "actor.ppo_max_token_len_per_micro_batch=2048", "actor.optim.lr=0.05",
        "trainer.total_steps=1", "trainer.progress=false",
        f"trainer.output_dir={tmp_path / 'run'}", *extra])


async def engine_and_actor_greedy(trainer, prompts):
    """Greedy continuations from the rollout engine (through the client) and from the actor."""
    client = trainer.client()
    worker = trainer.workers[0]
    pairs = []
    for index, prompt in enumerate(prompts):
        output = await client.generate(GenerateRequest(f"check-{trainer.step}-{index}", prompt,
                                       {"temperature": 0.0, "max_tokens": 8, "logprobs": True}))
        assert output.extra_fields["global_steps"] == trainer.step
        actor = await worker.actor_greedy.remote(prompt, len(output.token_ids))
        pairs.append((output.token_ids, actor))
    return pairs


def test_sync_loop_engine_tracks_actor(tmp_path, ray_cluster):
    config = tiny_config(tmp_path)

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            rows = trainer.train_rows(0)
            prompts = [trainer.runner.loop.chat_format.prompt_ids(row.messages, trainer.runner.loop.tools.schemas())
                       for row in rows]
            checks = []
            for total in (1, 2):
                trainer.config.trainer.total_steps = total
                await fit_sync(trainer)
                assert trainer.step == total
                checks.append(await engine_and_actor_greedy(trainer, prompts))
                trajectories = await trainer.generate(rows, trainer.step)
                assert {(t.min_global_steps, t.max_global_steps) for t in trajectories} == {(total, total)}
            return checks
        finally:
            await trainer.stop()

    checks = asyncio.run(run())
    for pairs in checks:
        for engine_tokens, actor_tokens in pairs:
            assert engine_tokens == actor_tokens
    from tandem.trainer.metrics import read_metrics

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in records if "time/generate" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["weight_version"] == r["step"] for r in steps)
    # step 2 was sampled after the first update's sync: had the sync failed, the actor (moved
    # with lr 0.05) and the engine would disagree by far more than float noise
    assert steps[1]["rollout_gap/abs_diff_max"] < 1e-4 and steps[0]["actor/grad_norm"] > 0
    for key in ("reward/mean", "rollout_gap/abs_diff_mean", "actor/policy/clip_fraction_upper", "actor/grad_norm",
                "time/update", "time/sync", "throughput/generated_tokens_per_second"):
        assert key in steps[0], key
    # the engine's admission per step: every turn of the 2 x 2 sessions admitted, none preempted
    assert steps[0]["rollout/admitted"] >= 4 and steps[0]["rollout/preemptions"] == 0
    # start-up, once: in the step-0 validation record, its parts adding up to the total
    [startup] = [r for r in records if "time/startup" in r]
    assert startup["step"] == 0 and "val/reward" in startup
    parts = {k: v for k, v in startup.items() if k.startswith("time/startup/")}
    assert set(parts) == {f"time/startup/{name}" for name in ("trainer", "data", "ray", "workers",
                                                              "servers", "weights", "first_token")}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(startup["time/startup"])


def test_resume_from_checkpoint_reproduces_next_step(tmp_path, ray_cluster):
    """Kill after step 1 (its checkpoint is the latest), resume: step 2's metrics match."""
    config = tiny_config(tmp_path, "trainer.total_steps=2", "trainer.save_freq=1")

    async def run(config):
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit_sync(trainer)
        finally:
            await trainer.stop()

    asyncio.run(run(config))
    from tandem.trainer.metrics import read_metrics

    run_dir = tmp_path / "run"
    first = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "time/generate" in r}
    # the run "died" right after saving step 1
    (run_dir / "checkpoints" / "latest").write_text("1")
    resumed_config = tiny_config(tmp_path, "trainer.total_steps=2", "trainer.resume=true")
    asyncio.run(run(resumed_config))
    second = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "time/generate" in r}
    assert sorted(second) == [1, 2] and second[1] == first[1]  # step 1 kept, step 2 rewritten
    for key, value in first[2].items():
        if key.startswith(("time/", "throughput/")) or key.endswith(("tokens_per_second", "_s")):
            continue
        assert second[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_two_fsdp_workers_tempered_sampling(tmp_path, ray_cluster):
    """n_devices=2: FSDP2 over gloo, one rollout engine per worker; temperature 0.7 with
    processed logprobs: the actor re-forward matches the rollout's log-probs."""
    config = tiny_config(tmp_path, "trainer.n_devices=2", "actor.fsdp_size=2", "rollout.temperature=0.7",
                         "rollout.logprobs_mode=processed", "trainer.total_steps=1")

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit_sync(trainer)
            status = await trainer.fleet.rollout.status()
            return trainer.step, status
        finally:
            await trainer.stop()

    step, status = asyncio.run(run())
    assert step == 1
    from tandem.trainer.metrics import read_metrics

    record = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r][0]
    assert record["rollout_gap/abs_diff_max"] < 1e-4
    assert record["actor/step_skipped"] == 0.0
    # sequence balancing reported: the step's imbalance is at most its worst mini-batch's
    assert 1.0 <= record["balance/token_imbalance"] <= record["balance/token_imbalance_worst_mini_batch"]
    # rollout data parallelism: both workers' engines served requests
    assert len(status.servers) == 2 and all(load.requests > 0 for load in status.servers)
    assert all(load.in_flight == 0 for load in status.servers)
