"""trainer_mode=sync: one set of devices, used in turn by the rollout engine and the actor.

The phase order is `fit_sync` below (seed §12.1): at start, sync weights into the rollout;
each step: generate -> sleep rollout -> reward -> old_log_prob -> ref_log_prob -> values ->
advantages -> update -> sync weights and wake (weights first, load, then KV cache). A step
whose sessions all fail is skipped (RLTrainer.skip_step): no update, a warning and a metric.
"""

from __future__ import annotations

from tandem.agent.runner import AllSessionsFailed
from tandem.progress import progress_bar
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook


async def fit_sync(trainer: RLTrainer, on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps; returns the last validation metrics. on_validation(step,
    metrics) is called after each validation (before training, every test_freq, at the end)."""
    config = trainer.config.trainer
    validation = await trainer.begin(on_validation)
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
               initial=trainer.step, total=config.total_steps, disable=not config.progress)
    for _ in bar:
        timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
        try:
            with timer.phase("generate"):
                trajectories = await trainer.generate(trainer.train_rows(trainer.step), trainer.step)
        except AllSessionsFailed as error:
            await trainer.skip_step(error)
            continue
        with timer.phase("sleep"):
            await trainer.sleep_rollout()
        batch, metrics = await trainer.train_on(trajectories, timer)
        trainer.step += 1
        with timer.phase("sync"):
            metrics.update(await trainer.sync_weights())
        metrics = await trainer.finish_step(trajectories, batch, metrics, timer, on_validation)
        bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                        gap=f"{metrics.get('rollout_gap/abs_diff_mean', 0):.1e}")
    return await trainer.end(on_validation, validation)
