"""Dynamic sampling end to end on a tiny model, in sync and separate_async: on prompts half of
which are always solved, every trained group has advantages that vary, every step trains a full
batch and logs filter/gen_batches."""

import asyncio
import json
from pathlib import Path

import torch
from test_trainer_sync import tiny_config

from tandem.batch.jagged import non_tensor_list
from tandem.demo.tasks import write_jsonl
from tandem.rewards import RewardResult, register_reward
from tandem.trainer.metrics import read_metrics
from tandem.trainer.ppo import dense
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.separate_async import fit_separate_async
from tandem.trainer.sync import fit_sync


@register_reward("test_half_solved")
def half_solved_reward(response_text, ground_truth, extra_info):
    """Even rows: 1 whatever the answer; odd rows: 1 when the reply has an even length."""
    solved = extra_info["index"] % 2 == 0 or len(response_text) % 2 == 0
    return RewardResult(float(solved), {"acc": float(solved)})


def half_solved_config(tmp_path, *extra):
    config = tiny_config(tmp_path, "rollout.n=4", "rollout.multi_turn.enable=false",
                         "rollout.multi_turn.tools=[]", "algorithm.filter_groups.enable=true",
                         "algorithm.filter_groups.metric=acc", "trainer.total_steps=2", *extra)
    train = Path(config.data.train_files[0])
    with open(train) as file:
        rows = [json.loads(line) for line in file]
    write_jsonl([{**row, "data_source": "test_half_solved"} for row in rows], train)
    return config


def run_and_record(config, fit):
    """Train with `fit`; returns the (uid -> advantages) of every trained group, per update."""
    updates = []

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        compute = trainer.compute_advantages

        def spy(batch):
            metrics = compute(batch)
            groups = {}
            advantages, mask = dense(batch, "advantages"), dense(batch, "response_mask")
            for row, uid in enumerate(non_tensor_list(batch, "uid")):
                if not bool(batch["is_padding"][row]):
                    groups.setdefault(uid, []).append(float(advantages[row][mask[row] > 0][0]))
            updates.append(groups)
            return metrics

        trainer.compute_advantages = spy
        try:
            await fit(trainer)
        finally:
            await trainer.stop()

    asyncio.run(run())
    return updates


def assert_every_group_varies(updates, groups_per_update):
    assert updates
    for groups in updates:
        assert len(groups) == groups_per_update  # the batch is full
        for uid, advantages in groups.items():
            assert torch.tensor(advantages).var() > 0, uid


def test_sync_trains_full_batches_of_groups_with_signal(tmp_path, ray_cluster):
    config = half_solved_config(tmp_path)
    updates = run_and_record(config, fit_sync)
    assert_every_group_varies(updates, config.data.train_batch_size)
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "filter/gen_batches" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["filter/groups_kept"] == 2 and record["filter/groups_dropped"] >= 1
        assert record["filter/gen_batches"] >= 2  # one prompt of each 2-prompt batch is solved


def test_separate_async_trains_full_batches_of_groups_with_signal(tmp_path, ray_cluster):
    config = half_solved_config(tmp_path, "trainer.trainer_mode=separate_async",
                                "trainer.async_rollout.max_staleness=1")
    updates = run_and_record(config, fit_separate_async)
    sync_step = config.trainer.separate_async.parameter_sync_step
    assert len(updates) == 2 * sync_step
    assert_every_group_varies(updates, config.actor.ppo_mini_batch_size)
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "filter/gen_batches" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["filter/groups_kept"] == 2 for r in steps)
    assert sum(r["filter/groups_dropped"] for r in steps) >= 2
    assert all(r["staleness/lag_max"] <= 1 for r in steps)


def test_a_resumed_separate_async_run_draws_on_from_the_checkpointed_cursor(tmp_path, ray_cluster):
    """The producer draws prompt batches through the trainer's cursor, which the checkpoint
    keeps: resumed, it starts at the first batch the first run had not drawn when it saved
    (under filtering that is past the step count), never at a batch already drawn."""
    from tandem.training import checkpoint

    drawn: list[list[int]] = []

    def run(*extra):
        config = half_solved_config(tmp_path, "trainer.trainer_mode=separate_async",
                                    "trainer.async_rollout.max_staleness=1", *extra)
        indices: list[int] = []
        drawn.append(indices)

        async def main():
            trainer = RLTrainer(config)
            await trainer.start()
            rows = trainer.train_rows
            trainer.train_rows = lambda index: indices.append(index) or rows(index)
            try:
                await fit_separate_async(trainer)
            finally:
                await trainer.stop()

        asyncio.run(main())

    run("trainer.save_freq=2")
    saved = checkpoint.load_trainer_state(tmp_path / "run" / "checkpoints" / "step_2")
    assert saved["step"] == 2 and saved["prompt_batch"] > 2  # filtering drew extra batches
    assert set(range(saved["prompt_batch"])) <= set(drawn[0])
    run("trainer.total_steps=3", "trainer.resume=true", "trainer.save_freq=0")
    assert drawn[1] and min(drawn[1]) == drawn[1][0] == saved["prompt_batch"]
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "filter/gen_batches" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
