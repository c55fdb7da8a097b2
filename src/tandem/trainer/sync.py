"""trainer_mode=sync: one set of devices, used in turn by the rollout engine and the actor.

The phase order is `fit_sync` below (seed §12.1): at start, sync weights into the rollout;
each step: generate -> sleep rollout -> reward -> old_log_prob -> ref_log_prob -> values ->
advantages -> update -> sync weights and wake (weights first, load, then KV cache).
"""

from __future__ import annotations

from typing import Callable

from tqdm import tqdm

from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.rl_trainer import RLTrainer


async def fit_sync(trainer: RLTrainer,
                   on_validation: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Train for trainer.total_steps; returns the last validation metrics. on_validation(step,
    metrics) is called after each validation (before training, every test_freq, at the end)."""
    config = trainer.config.trainer

    async def validate() -> dict[str, float]:
        metrics = await trainer.validate()
        if metrics and on_validation is not None:
            on_validation(trainer.step, metrics)
        return metrics

    if config.resume:
        await trainer.load_latest_checkpoint()
    await trainer.sync_weights()  # on init: the rollout starts from the actor's weights
    validation: dict[str, float] = {}
    if trainer.step == 0:  # a resumed run validated this step before it stopped
        validation = await validate()
        if validation:
            trainer.metrics.log(0, validation)
    name = "GRPO" if trainer.config.algorithm.adv_estimator == "grpo" else "PPO"
    bar = tqdm(range(trainer.step, config.total_steps), desc=f"{name} steps", initial=trainer.step,
               total=config.total_steps, disable=not config.progress)
    for _ in bar:
        timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{name} step [{phase}]"))
        with timer.phase("generate"):
            trajectories = await trainer.generate(trainer.train_rows(trainer.step), trainer.step)
        with timer.phase("sleep"):
            await trainer.sleep_rollout()
        with timer.phase("reward"):
            if trainer.config.reward.placement == "after_sampling":
                trainer.compute_rewards(trajectories)
        batch = trainer.make_batch(trajectories)
        with timer.phase("old_log_prob"):
            await trainer.compute_old_log_probs(batch)
        with timer.phase("ref_log_prob"):
            await trainer.compute_ref_log_probs(batch)
        with timer.phase("values"):
            await trainer.compute_values(batch)
        with timer.phase("advantages"):
            metrics = trainer.compute_advantages(batch)
        with timer.phase("update"):
            metrics.update(await trainer.update(batch))
        trainer.step += 1
        with timer.phase("sync"):
            metrics.update(await trainer.sync_weights())
        metrics.update(trainer.batch_metrics(trajectories, batch))
        metrics.update(timer.metrics())
        metrics.update(await trainer.manager.fault_metrics())  # dead servers, retried requests
        generated = sum(int(t.response_mask.sum()) for t in trajectories)
        metrics["throughput/generated_tokens_per_second"] = generated / max(timer.times["generate"], 1e-9)
        metrics["weight_version"] = trainer.step
        if config.test_freq and trainer.step % config.test_freq == 0 and trainer.step < config.total_steps:
            validation = await validate()
            metrics.update(validation)
        if config.save_freq and trainer.step % config.save_freq == 0:
            await trainer.save_checkpoint()
        trainer.metrics.log(trainer.step, metrics)
        bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                        gap=f"{metrics.get('rollout_gap/abs_diff_mean', 0):.1e}")
    if trainer.step >= config.total_steps:
        validation = await validate()
        if validation:
            trainer.metrics.log(trainer.step, validation)
    return validation
