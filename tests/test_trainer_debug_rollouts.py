"""Rollout record and replay (trainer.debug): a run saves each step's scored trajectories, another
trains on them without generating and reaches the same losses; rollout_only records without
training; the switches are checked at load."""

import asyncio
import json

import pytest

from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.trainer.rollout_files import load_rollouts, save_rollouts, step_file


def config_for(tmp_path, run: str, *extra):
    train, _ = make_datasets(tmp_path / "data", 8, 2, seed=0)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.train_batch_size=2",
        "data.shuffle=false", "rollout.n=2", "rollout.prompt_length=320",
        "rollout.response_length=12", "rollout.kv_cache_memory_bytes=16777216",
        "actor.ppo_mini_batch_size=2", "actor.ppo_max_token_len_per_micro_batch=2048",
        "actor.optim.lr=0.05", "trainer.total_steps=2", "trainer.progress=false",
        f"trainer.output_dir={tmp_path / run}", *extra])


@pytest.mark.parametrize("overrides, message", [
    (["trainer.debug.rollout_only=true"], r"trainer\.debug\.rollout_only: .*save_rollouts"),
    (["trainer.debug.train_only=true"], r"trainer\.debug\.train_only: .*set both"),
    (["trainer.debug.load_rollouts=somewhere"], r"trainer\.debug\.train_only: .*set both"),
    (["trainer.debug.rollout_only=true", "trainer.debug.train_only=true",
      "trainer.debug.load_rollouts=x", "trainer.debug.save_rollouts=y"],
     r"rollout_only: and train_only are both true"),
    (["trainer.debug.save_rollouts=x", "trainer.trainer_mode=colocate_async"],
     r"trainer\.debug: .*trainer_mode=sync only"),
])
def test_the_switches_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_missing_step_names_the_file_and_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"trainer\.debug\.load_rollouts: .*step_000003\.pt "
                                                r"does not exist"):
        load_rollouts(tmp_path, 3)


@pytest.mark.slow
def test_replayed_rollouts_train_to_the_same_losses_without_generating(tmp_path, ray_cluster):
    from tandem.trainer.modes import fit
    from tandem.trainer.rl_trainer import RLTrainer

    async def run(config):
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit(trainer)
            stats = await trainer.fleet.rollout.stats()
        finally:
            await trainer.stop()
        return trainer, sum(s["backend"]["generated_tokens"] for s in stats.values())

    recorded = tmp_path / "rollouts"
    first, generated = asyncio.run(run(config_for(tmp_path, "first",
                                                  f"trainer.debug.save_rollouts={recorded}")))
    assert generated > 0 and first.updates == 2
    assert step_file(recorded, 1).is_file() and step_file(recorded, 2).is_file()
    saved = load_rollouts(recorded, 1)
    assert len(saved) == 4 and all(t.reward is not None for t in saved)

    replay, generated = asyncio.run(run(config_for(tmp_path, "replay",
                                                   f"trainer.debug.load_rollouts={recorded}",
                                                   "trainer.debug.train_only=true")))
    assert generated == 0 and replay.updates == 2  # trained on the saved steps, generated nothing
    losses = [[r["actor/loss"] for r in metrics_of(tmp_path / run) if "actor/loss" in r]
              for run in ("first", "replay")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]  # same weights, same data: same numbers

    only, generated = asyncio.run(run(config_for(tmp_path, "only", "trainer.debug.rollout_only=true",
                                                 f"trainer.debug.save_rollouts={tmp_path / 'only_rollouts'}")))
    assert generated > 0 and only.updates == 0 and only.step == 2
    assert step_file(tmp_path / "only_rollouts", 2).is_file()
    assert not [r for r in metrics_of(tmp_path / "only") if "actor/loss" in r]


def test_a_saved_step_comes_back_field_for_field(tmp_path):
    import torch

    from tandem.batch.trajectory import Trajectory

    trajectory = Trajectory(prompts=torch.tensor([5, 6, 7]), responses=torch.tensor([8, 9]),
                            response_mask=torch.tensor([1, 0]),
                            rollout_log_probs=torch.tensor([-0.5, 0.0]), min_global_steps=3,
                            max_global_steps=3, uid="u", reward=1.0,
                            reward_extra={"acc": 1.0}, ground_truth={"answer": [1, 2]},
                            metadata={"response_text": "ok", "messages": [{"role": "user"}]})
    save_rollouts(tmp_path, 4, [trajectory])
    (back,) = load_rollouts(tmp_path, 4)
    for name, value in vars(trajectory).items():
        other = getattr(back, name)
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


def test_a_saved_step_keeps_its_images(tmp_path):
    """A vision-language run's trajectories come back with their pixel values, grids, token
    counts and digests."""
    import torch

    from tandem.batch.trajectory import Trajectory
    from tandem.multimodal import ImageInputs

    images = ImageInputs(torch.randn(8, 6), torch.tensor([[1, 2, 4]]), [2], [b"\x01digest"])
    trajectory = Trajectory(prompts=torch.tensor([5, 6, 7]), responses=torch.tensor([8]),
                            response_mask=torch.tensor([1]), rollout_log_probs=torch.tensor([-0.5]),
                            min_global_steps=1, max_global_steps=1, uid="u", reward=0.0,
                            images=images)
    save_rollouts(tmp_path, 1, [trajectory])
    (back,) = load_rollouts(tmp_path, 1)
    assert torch.equal(back.images.pixel_values, images.pixel_values)
    assert torch.equal(back.images.grid_thw, images.grid_thw)
    assert (back.images.token_counts, back.images.digests) == ([2], [b"\x01digest"])
