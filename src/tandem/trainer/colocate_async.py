"""trainer_mode=colocate_async: one set of devices (hybrid workers), but generation never waits
for a batch boundary (seed §12.2).

A producer keeps prompt groups generating in the background into the rollout buffer. Each step,
in `fit_colocate_async` below: take a batch of finished groups within max_staleness ->
abort unfinished requests -> sleep the rollout -> train (trainer.train_on) -> sync weights ->
resume generation. The resumable client finishes the aborted requests with the new weights:
their tokens so far are kept, the budget shrinks, no token is generated twice, and each
trajectory records the first and last weight versions it used.

Resume: a resumed run restarts generation from the checkpointed version with an empty buffer
(groups that were generating or waiting at the checkpoint are drawn again from the dataset
order of the checkpointed step).
"""

from __future__ import annotations

from tandem.progress import progress_bar
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook
from tandem.trainer.rollout_buffer import RolloutBuffer, check_staleness


async def fit_colocate_async(trainer: RLTrainer,
                             on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps; returns the last validation metrics (see fit_sync)."""
    config = trainer.config.trainer
    policy = config.async_rollout
    validation = await trainer.begin(on_validation)
    batch_size = trainer.config.data.train_batch_size
    buffer = RolloutBuffer(policy.buffer_groups or 2 * batch_size)
    producer = RolloutProducer(trainer, buffer, start_batch=trainer.step)
    producer.start()
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
               initial=trainer.step, total=config.total_steps, disable=not config.progress)
    try:
        for _ in bar:
            timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
            with timer.phase("wait_rollout"):
                groups, stale, buffer_metrics = await buffer.take(
                    batch_size, trainer.step, policy.max_staleness, policy.on_stale)
            if policy.on_stale == "regenerate":
                for group in stale:
                    producer.resubmit(group)
            with timer.phase("abort"):
                await trainer.manager.abort_all_requests()
            with timer.phase("sleep"):
                await trainer.sleep_rollout()
            trajectories = [t for group in groups for t in group.trajectories]
            check_staleness(trajectories, trainer.step, policy.max_staleness)
            batch, metrics = await trainer.train_on(trajectories, timer)
            trainer.step += 1
            with timer.phase("sync"):
                metrics.update(await trainer.sync_weights())
            with timer.phase("resume"):
                await trainer.manager.resume_generation()
            metrics.update(buffer_metrics)
            metrics = await trainer.finish_step(trajectories, batch, metrics, timer, on_validation)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                            lag=f"{metrics['staleness/lag_mean']:.2f}")
    finally:
        await producer.stop()
        await trainer.manager.abort_all_requests()
        await trainer.manager.resume_generation()
    return await trainer.end(on_validation, validation)
