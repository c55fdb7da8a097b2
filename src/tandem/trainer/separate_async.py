"""trainer_mode=separate_async: STANDALONE rollout replicas on devices of their own keep
generating while the actor trains on the hybrid workers (seed §12.3; docs/trainer.md).

A producer keeps prompt groups generating into the rollout buffer without pause;
`fit_separate_async` below is a step's phase order: parameter_sync_step mini-batch updates, then
one weight sync through the checkpoint engine (the servers never sleep, so nothing is woken),
then the pool takes rollout.elastic's size for the new step.
With trainer.separate_async.spillover the training workers' engines generate too while the
trainer waits (fleet/spillover.py). Resume is as in colocate_async.
"""

from __future__ import annotations

import asyncio
import time

from tandem.progress import progress_bar
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook
from tandem.trainer.rollout_buffer import RolloutBuffer, check_staleness, make_buffer
from tandem.fleet.spillover import Spillover
from tandem.trainer.step_metrics import idle_metrics, merge_mini_batch_metrics


async def fit_separate_async(trainer: RLTrainer,
                             on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps (one step = parameter_sync_step mini-batch updates, then
    one weight sync); returns the last validation metrics (see fit_sync)."""
    config, fleet = trainer.config.trainer, trainer.fleet
    policy = config.async_rollout
    sync_step = config.separate_async.parameter_sync_step
    mini_batch = trainer.config.actor.ppo_mini_batch_size
    if config.resume:
        await trainer.load_latest_checkpoint()
    await fleet.sync_weights(trainer.step)
    await fleet.follow_schedule(trainer.step)  # rollout.elastic: the pool's size at this step
    trainer.startup.mark("weights")
    validation = await trainer.validate_first(on_validation)
    spill = None
    if config.separate_async.spillover:
        spill = Spillover(fleet, config.separate_async.spill_below_groups or mini_batch)
        await spill.start()
    buffer = make_buffer(policy, trainer.config.data.train_batch_size, trainer.step)
    producer = RolloutProducer(trainer, buffer)
    idle = RolloutIdleClock(buffer)
    last: dict[str, float] | None = None  # the previous step's metrics (its idle fractions)
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
                       initial=trainer.step, total=config.total_steps, disable=not config.progress)
    try:
        if spill is not None and spill.should_join(buffer.depth, trainer.step, config.total_steps):
            await spill.join(trainer.step)  # before the first groups start: they spread over it too
        producer.start()
        for _ in bar:
            timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
            idle.reset()
            trajectories, batches, parts, groups_trained = [], [], [], 0
            spilled = spill.spilled_tokens if spill else 0
            for _ in range(sync_step):
                with timer.phase("wait_rollout"):  # a silent pool stops the run, or restarts
                    groups, stale, buffer_metrics = await fleet.while_rollout_answers(
                        buffer.take(mini_batch, trainer.step), "wait_rollout")
                if spill is not None:
                    with timer.phase("spill_leave"):
                        await spill.leave()
                if policy.on_stale == "regenerate":
                    for group in stale:
                        producer.resubmit(group)
                mini = [t for group in groups for t in group.trajectories]
                check_staleness(mini, trainer.step, policy.max_staleness)
                with timer.phase("reward"):
                    await trainer.compute_rewards(mini)
                batch = trainer.make_batch(mini)
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
                trajectories += mini
                groups_trained += len(groups)
                batches.append(batch)
                parts.append({**metrics, **buffer_metrics})
            trainer.step += 1
            with timer.phase("sync"):
                sync_metrics = await fleet.sync_weights(trainer.step)
            with timer.phase("resize"):  # added replicas load the version just synced
                await fleet.follow_schedule(trainer.step)
                await fleet.follow_pressure(last)  # rollout.elastic.auto: the last step's idle
            # the actor holds the served version until the next update; joining before the bound
            # admits this version's groups lets them start on the spill engines too
            if spill is not None and spill.should_join(buffer.depth, trainer.step,
                                                       config.total_steps):
                with timer.phase("spill_join"):
                    await spill.join(trainer.step)
            buffer.serving(trainer.step)  # the bound now admits groups that start at this version
            metrics = merge_mini_batch_metrics(parts)
            metrics.update(sync_metrics)
            metrics.update(producer.filter_metrics(groups_trained))  # algorithm.filter_groups
            metrics.update(idle_metrics(timer.times, idle.seconds, sync_metrics["sync/total_s"]))
            if spill is not None:
                metrics["spill/tokens"] = float(spill.spilled_tokens - spilled)
                metrics["spill/joins_total"] = float(spill.joins)
            last = metrics
            metrics = await trainer.step_record(trajectories, batches, metrics, timer)
            if trainer.validation_due():
                metrics.update(await trainer.validate_and_report(on_validation))
            if trainer.checkpoint_due():
                await trainer.save_checkpoint()
            await trainer.log_step(metrics)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                            lag=f"{metrics['staleness/lag_mean']:.2f}")
    finally:
        idle.stop()
        if spill is not None:
            await spill.leave()
        await producer.stop()
    # after the run only (a failed one would wait on the server that failed it): what the
    # stopped producer left running ends, and generation reopens for the last validation
    await fleet.abort()
    await fleet.resume()
    return await trainer.validate_last(on_validation, validation)


class RolloutIdleClock:
    """Seconds in which no prompt group was generating (the producer held back by a full
    buffer), sampled every `period_s` in the background."""

    def __init__(self, buffer: RolloutBuffer, period_s: float = 0.01) -> None:
        self.buffer = buffer
        self.period_s = period_s
        self.seconds = 0.0
        self._task = asyncio.create_task(self._sample(), name="rollout-idle-clock")

    def reset(self) -> None:
        """Start counting a new step."""
        self.seconds = 0.0

    def stop(self) -> None:
        """End the sampling task."""
        self._task.cancel()

    async def _sample(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            if self.buffer.in_flight == 0:
                self.seconds += now - last
            last = now
