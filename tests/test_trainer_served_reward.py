"""Every trainer mode trains with a served reward: the reward model (and the judge) score each
trajectory, their scores are the step's reward, and with agent_loop placement the scoring
overlaps generation (time/reward_overlapped, drawn on the timeline)."""

import asyncio

import pytest

from tandem.trainer.colocate_async import fit_colocate_async
from tandem.trainer.metrics import read_metrics
from tandem.trainer.plots import plot_run
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.separate_async import fit_separate_async
from tandem.trainer.sync import fit_sync
from test_trainer_sync import tiny_config

MODEL = ["reward.model.enable=true", "reward.model.path=tiny:reward", "reward.model.weight=2.0"]
JUDGE = ["reward.judge.enable=true", "reward.judge.path=tiny:qwen2", "reward.judge.max_new_tokens=4",
         "reward.judge.prompt_length=512", "reward.judge.verdict_pattern=(\\d)"]
QUICK = ["rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]", "rollout.response_length=8"]

MODES = {
    "sync": (fit_sync, ["reward.placement=after_sampling", "reward.rule_weight=0", *MODEL]),
    # both served on the training workers' bundle (n_devices=0), scored after sampling
    "sync_shared_devices": (fit_sync, ["reward.placement=after_sampling", *MODEL, *JUDGE,
                                       "reward.model.n_devices=0", "reward.judge.n_devices=0"]),
    "colocate_async": (fit_colocate_async, ["trainer.trainer_mode=colocate_async",
                                            "trainer.async_rollout.max_staleness=1", *MODEL, *JUDGE]),
    "separate_async": (fit_separate_async, ["trainer.trainer_mode=separate_async",
                                            "trainer.async_rollout.max_staleness=1",
                                            "reward.rule_weight=0", *MODEL]),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_trainer_mode_trains_with_a_served_reward(tmp_path, ray_cluster, mode):
    fit, overrides = MODES[mode]
    config = tiny_config(tmp_path, *QUICK, *overrides)
    scored = []

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        original = trainer.make_batch

        def spy(trajectories):  # every trajectory of an update carries the served scores
            scored.extend((t.reward, dict(t.reward_extra)) for t in trajectories)
            return original(trajectories)

        trainer.make_batch = spy
        try:
            await fit(trainer)
            return trainer.step
        finally:
            await trainer.stop()

    assert asyncio.run(run()) == 1
    assert scored
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/update" in r]
    assert len(records) == 1
    record = records[0]
    if "reward.placement=after_sampling" in overrides:  # scored in the reward phase
        assert record["time/reward"] > 0 and "time/reward_overlapped" not in record
    else:  # agent_loop placement: the reward worker scored while generation went on
        assert record["time/reward_overlapped"] > 0
        assert record["reward/mean"] == pytest.approx(sum(r for r, _ in scored) / len(scored))
    if mode == "sync":  # only the reward model: the reward is 2 x its score
        assert all(extra.get("reward_failed") is None for _, extra in scored)
        assert len({reward for reward, _ in scored}) > 1  # a score per trajectory, not a constant
    if mode in ("colocate_async", "sync_shared_devices"):  # rule + model + judge, weighted sum
        for reward, extra in scored:
            if not extra.get("reward_failed"):
                expected = (extra["reward/test_parity"] if "reward/test_parity" in extra else
                            extra["reward/registry"]) + 2 * extra["reward/reward_model"] + extra["reward/judge"]
                assert reward == pytest.approx(expected)
        assert "serving/judge_dead_servers" in record
        assert record["reward/reward_model"] == pytest.approx(
            sum(extra.get("reward/reward_model", 0.0) for _, extra in scored
                if "reward/reward_model" in extra) / sum("reward/reward_model" in e for _, e in scored))
    assert "serving/reward_model_dead_servers" in record
    assert (tmp_path / "run" / "timeline.png") in plot_run(tmp_path / "run")
