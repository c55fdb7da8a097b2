"""trainer_mode=separate_async: STANDALONE rollout replicas on devices of their own keep
generating while the actor trains on the hybrid workers (seed §12.3).

A producer keeps prompt groups generating into the rollout buffer without pause. Each step, in
`fit_separate_async` below: parameter_sync_step times {take one mini-batch of finished groups
within max_staleness -> train on it (trainer.train_on: one optimizer step per epoch)} -> sync
the actor's weights into every standalone server through the non-naive checkpoint engine
(WeightSyncManager: abort -> release KV -> transfer -> resume). The resumable client finishes
the requests a sync aborted with the new weights (no token generated twice). The servers stop
only for the sync and when back-pressure holds the producer (the buffer is full). With
trainer.separate_async.spillover the training workers' engines generate too while the trainer
waits for its first mini-batch of a step (trainer/spillover.py).

Resume: as colocate_async, a resumed run restarts generation from the checkpointed version with
an empty buffer.
"""

from __future__ import annotations

import asyncio
import time

from tandem.progress import progress_bar
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook
from tandem.trainer.rollout_buffer import RolloutBuffer, check_staleness
from tandem.trainer.spillover import Spillover


async def fit_separate_async(trainer: RLTrainer,
                             on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps (one step = parameter_sync_step mini-batch updates, then
    one weight sync); returns the last validation metrics (see fit_sync)."""
    config = trainer.config.trainer
    policy = config.async_rollout
    sync_step = config.separate_async.parameter_sync_step
    mini_batch = trainer.config.actor.ppo_mini_batch_size
    validation = await trainer.begin(on_validation)
    spill = None
    if config.separate_async.spillover:
        spill = Spillover(trainer, config.separate_async.spill_below_groups or mini_batch)
        await spill.start()
    buffer = RolloutBuffer(policy.buffer_groups or 2 * trainer.config.data.train_batch_size)
    producer = RolloutProducer(trainer, buffer, start_batch=trainer.step)
    producer.start()
    idle = RolloutIdleClock(buffer)
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
               initial=trainer.step, total=config.total_steps, disable=not config.progress)
    try:
        for _ in bar:
            timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
            idle.reset()
            trajectories, batches, parts = [], [], []
            spilled = spill.spilled_tokens if spill else 0
            for index in range(sync_step):
                with timer.phase("wait_rollout"):
                    # spill only while the actor still holds the served version (no update yet)
                    if spill is not None and index == 0 and spill.should_join(buffer.depth):
                        await spill.join()
                    groups, stale, buffer_metrics = await buffer.take(
                        mini_batch, trainer.step, policy.max_staleness, policy.on_stale)
                if spill is not None:
                    with timer.phase("spill_leave"):
                        await spill.leave()
                if policy.on_stale == "regenerate":
                    for group in stale:
                        producer.resubmit(group)
                mini = [t for group in groups for t in group.trajectories]
                check_staleness(mini, trainer.step, policy.max_staleness)
                batch, metrics = await trainer.train_on(mini, timer)
                trajectories += mini
                batches.append(batch)
                parts.append({**metrics, **buffer_metrics})
            trainer.step += 1
            with timer.phase("sync"):
                sync_metrics = await trainer.sync_weights()
            metrics = merge_mini_batch_metrics(parts)
            metrics.update(sync_metrics)
            metrics.update(idle_metrics(timer, idle.seconds, sync_metrics["sync/total_s"]))
            if spill is not None:
                metrics["spill/tokens"] = float(spill.spilled_tokens - spilled)
                metrics["spill/joins_total"] = float(spill.joins)
            metrics = await trainer.finish_step(trajectories, batches, metrics, timer, on_validation)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                            lag=f"{metrics['staleness/lag_mean']:.2f}")
    finally:
        idle.stop()
        if spill is not None:
            await spill.leave()
        await producer.stop()
        await trainer.manager.abort_all_requests()
        await trainer.manager.resume_generation()
    return await trainer.end(on_validation, validation)


def merge_mini_batch_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One record for a step's mini-batches: means, except maxima (lag_max), sums (buffer
    wait) and the latest value of running totals."""
    merged = {key: sum(p.get(key, 0.0) for p in parts) / len(parts)
              for key in {key for p in parts for key in p}}
    merged["staleness/lag_max"] = max(p["staleness/lag_max"] for p in parts)
    merged["buffer/wait_seconds"] = sum(p["buffer/wait_seconds"] for p in parts)
    for key in ("staleness/dropped_total", "staleness/regenerated_total"):
        merged[key] = parts[-1][key]
    return merged


def idle_metrics(timer: PhaseTimer, backpressure_s: float, sync_s: float) -> dict[str, float]:
    """Trainer idle = waiting for data; rollout idle = held back by a full buffer + paused by the sync."""
    wall = max(sum(timer.times.values()), 1e-9)
    trainer_idle = timer.times.get("wait_rollout", 0.0)
    rollout_idle = min(backpressure_s + sync_s, wall)
    return {"idle/trainer_seconds": trainer_idle, "idle/trainer_fraction": trainer_idle / wall,
            "idle/rollout_seconds": rollout_idle, "idle/rollout_fraction": rollout_idle / wall}


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
