"""trainer_mode=sync: generation and training take turns (seed §12.1); `fit_sync` below is the
phase order (docs/trainer.md). On the hybrid layout sleep and wake free the devices for
training; standalone replicas keep their memory. A step whose sessions all fail is skipped
(RLTrainer.skip_step): no update, a warning and a metric. With algorithm.filter_groups the generate
phase scores and filters groups and draws more prompt batches (trainer/dynamic_sampling.py). trainer.debug records each step's
scored trajectories, or replays recorded ones in place of generation (docs/trainer.md).
"""

from __future__ import annotations

from tandem.agent.runner import AllSessionsFailed
from tandem.progress import progress_bar
from tandem.trainer.dynamic_sampling import NoGroupKept, fill_batch
from tandem.trainer.metrics import PhaseTimer
from tandem.trainer.rl_trainer import RLTrainer, ValidationHook
from tandem.trainer.rollout_files import load_rollouts, save_rollouts


async def fit_sync(trainer: RLTrainer, on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Train for trainer.total_steps; returns the last validation metrics. on_validation(step,
    metrics) is called after each validation (before training, every test_freq, at the end)."""
    config, fleet = trainer.config.trainer, trainer.fleet
    if config.resume:
        await trainer.load_latest_checkpoint()
    await fleet.wake_rollout(["weights"])
    await fleet.sync_weights(trainer.step)
    await fleet.wake_rollout(["kv_cache"])
    await fleet.follow_schedule(trainer.step)  # rollout.elastic (standalone replicas only)
    trainer.startup.mark("weights")
    validation = await trainer.validate_first(on_validation)
    bar = progress_bar(range(trainer.step, config.total_steps), desc=f"{trainer.algorithm_name} steps",
                       initial=trainer.step, total=config.total_steps, disable=not config.progress)
    debug = config.debug  # rollout record and replay (trainer/rollout_files.py)
    filtering = trainer.config.algorithm.filter_groups.enable
    for _ in bar:
        timer = PhaseTimer(on_phase=lambda phase: bar.set_description(f"{trainer.algorithm_name} [{phase}]"))
        metrics: dict[str, float] = {}
        try:
            with timer.phase("generate"):
                if debug.train_only:
                    trajectories = load_rollouts(debug.load_rollouts, trainer.step + 1)
                elif filtering:  # generate, score, drop zero-variance groups, until full
                    trajectories, metrics = await fleet.wait_for_rollout(fill_batch(trainer))
                else:
                    index = trainer.next_prompt_batch()
                    trajectories = await fleet.wait_for_rollout(
                        trainer.generate(trainer.train_rows(index), index))
        except (AllSessionsFailed, NoGroupKept) as error:
            await trainer.skip_step(error)
            continue
        if not debug.rollout_only:
            with timer.phase("sleep"):
                await fleet.sleep_rollout()
        with timer.phase("reward"):
            if not debug.train_only:  # replayed trajectories keep the rewards they were saved with
                await trainer.compute_rewards(trajectories)
        if debug.save_rollouts:
            save_rollouts(debug.save_rollouts, trainer.step + 1, trajectories)
        batch = trainer.make_batch(trajectories)
        if not debug.rollout_only:  # record only: the same weights go on under the next version
            with timer.phase("old_log_prob"):
                await trainer.compute_old_log_probs(batch)
            with timer.phase("ref_log_prob"):
                await trainer.compute_ref_log_probs(batch)
            with timer.phase("values"):
                await trainer.compute_values(batch)
            with timer.phase("advantages"):
                metrics.update(trainer.compute_advantages(batch))
            with timer.phase("update"):
                metrics.update(await trainer.update(batch))
        trainer.step += 1
        with timer.phase("sync"):
            await fleet.wake_rollout(["weights"])
            metrics.update(await fleet.sync_weights(trainer.step))
            await fleet.wake_rollout(["kv_cache"])
        with timer.phase("resize"):
            await fleet.follow_schedule(trainer.step)
        metrics = await trainer.step_record(trajectories, [batch], metrics, timer)
        if trainer.validation_due():
            metrics.update(await trainer.validate_and_report(on_validation))
        if trainer.checkpoint_due():
            await trainer.save_checkpoint()
        await trainer.log_step(metrics)
        bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}",
                        gap=f"{metrics.get('rollout_gap/abs_diff_mean', 0):.1e}")
    return await trainer.validate_last(on_validation, validation)
