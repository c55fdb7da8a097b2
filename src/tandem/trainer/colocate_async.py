"""trainer_mode=colocate_async: generation never waits for a batch boundary, but stops for each
update on the same devices (seed §12.2; docs/trainer.md).

A producer keeps prompt groups generating into the rollout buffer; `fit_colocate_async` below is
a step's phase order. The resumable client finishes the requests aborted before the update with
the new weights (their tokens kept, none generated twice). A resumed run restarts generation
from the checkpointed version with an empty buffer (groups in flight then are drawn again).
"""

from __future__ import annotations

from tandem.progress import progress_bar
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook
from tandem.trainer.rollout_buffer import check_staleness, make_buffer


async def fit_colocate_async(trainer: RLTrainer,
                             on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps; returns the last validation metrics (see fit_sync)."""
    config, fleet = trainer.config.trainer, trainer.fleet
    policy = config.async_rollout
    if config.resume:
        await trainer.load_latest_checkpoint()
    await fleet.wake_rollout(["weights"])
    await fleet.sync_weights(trainer.step)
    await fleet.wake_rollout(["kv_cache"])
    await fleet.follow_schedule(trainer.step)  # rollout.elastic (standalone replicas only)
    trainer.startup.mark("weights")
    validation = await trainer.validate_first(on_validation)
    batch_size = trainer.config.data.train_batch_size
    buffer = make_buffer(policy, batch_size, trainer.step)
    producer = RolloutProducer(trainer, buffer)
    producer.start()
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
                       initial=trainer.step, total=config.total_steps, disable=not config.progress)
    try:
        for _ in bar:
            timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
            with timer.phase("wait_rollout"):
                groups, stale, buffer_metrics = await fleet.wait_for_rollout(
                    buffer.take(batch_size, trainer.step))
            if policy.on_stale == "regenerate":
                for group in stale:
                    producer.resubmit(group)
            with timer.phase("abort"):
                await fleet.abort()
            with timer.phase("sleep"):
                await fleet.sleep_rollout()
            trajectories = [t for group in groups for t in group.trajectories]
            check_staleness(trajectories, trainer.step, policy.max_staleness)
            with timer.phase("reward"):
                await trainer.compute_rewards(trajectories)
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
                await fleet.wake_rollout(["weights"])
                metrics.update(await fleet.sync_weights(trainer.step))
                await fleet.wake_rollout(["kv_cache"])
            with timer.phase("resize"):
                await fleet.follow_schedule(trainer.step)
            buffer.serving(trainer.step)  # the bound now admits groups that start at this version
            with timer.phase("resume"):
                await fleet.resume()
            metrics.update(buffer_metrics)
            metrics.update(producer.filter_metrics(len(groups)))  # algorithm.filter_groups
            metrics = await trainer.step_record(trajectories, [batch], metrics, timer)
            if trainer.validation_due():
                metrics.update(await trainer.validate_and_report(on_validation))
            if trainer.checkpoint_due():
                await trainer.save_checkpoint()
            await trainer.log_step(metrics)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                            lag=f"{metrics['staleness/lag_mean']:.2f}")
    finally:
        await producer.stop()
        await fleet.abort()
        await fleet.resume()
    return await trainer.validate_last(on_validation, validation)
