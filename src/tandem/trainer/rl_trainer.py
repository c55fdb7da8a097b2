"""What every trainer mode shares: Ray workers and servers, data, rewards, the phases of a PPO
step as named calls, validation, metrics and checkpoints. The modes (sync.py, ...) only decide
the order of these calls."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import ray
import torch
from omegaconf import OmegaConf
from ray.util.placement_group import PlacementGroup, remove_placement_group
from tensordict import TensorDict

from tandem import algorithms
from tandem.agent.dataset import DatasetRow, PromptDataset
from tandem.agent.runner import AgentLoopRunner, AllSessionsFailed
from tandem.batch.jagged import field_lengths, field_values, make_field, trajectories_to_batch
from tandem.batch.balance import balance_batch, token_imbalance
from tandem.batch.padding import drop_padding_samples, pad_for_data_parallel
from tandem.batch.trajectory import Trajectory
from tandem.config.load import to_yaml
from tandem.config.schema import TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.progress import progress_bar
from tandem.rewards.scorer import FAILED, RewardScorer
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.resumable_client import ResumableClient
from tandem.tools.registry import ToolRegistry
from tandem.trainer import placement, ppo
from tandem.trainer.hybrid_worker import HybridWorkerActor, needs_reference
from tandem.trainer.metrics import MetricsLogger, PhaseTimer
from tandem.trainer.startup import StartupClock
from tandem.training import checkpoint
from tandem.training.fsdp import shard_batch
from tandem.weight_sync.manager import WeightSyncManager

logger = logging.getLogger(__name__)

# on_validation(step, metrics): called after each validation (e.g. the demo's report)
ValidationHook = Callable[[int, dict[str, float]], None]


class RLTrainer:
    """Holds the workers, servers and data of one run; `step` is the actor's weight version."""

    def __init__(self, config: TandemConfig, evaluation_only: bool = False,
                 rewards: RewardScorer | None = None, tools: ToolRegistry | None = None) -> None:
        """evaluation_only: read a run's directory without writing to it (tandem eval).
        rewards: the job's reward functions (default: from config.reward); tools: the tool
        registry of the tool loop (default: rollout.multi_turn.tools)."""
        from transformers import AutoTokenizer

        self.startup = StartupClock()  # process start -> first token (time/startup)
        self.startup.mark("trainer")
        self.config = config
        self.evaluation_only = evaluation_only
        self.model_path = resolve_model_path(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.rewards = rewards or RewardScorer.from_config(config.reward, prompt_key=config.data.prompt_key)
        if self.rewards.decode is None:  # verl's solution_str: the whole decoded response
            self.rewards.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.tools = tools
        self.train_data = PromptDataset.from_config(config.data, "train")
        self.val_data = PromptDataset.from_config(config.data, "val") if config.data.val_files else None
        self.steps_per_epoch = len(self.train_data) // config.data.train_batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(f"data.train_batch_size={config.data.train_batch_size} is larger than "
                             f"the training set ({len(self.train_data)} rows); lower it")
        self.output_dir = Path(config.trainer.output_dir)
        self.metrics: MetricsLogger | None = None
        if not evaluation_only:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(to_yaml(config))
            trainer = config.trainer
            self.metrics = MetricsLogger(self.output_dir, trainer.loggers, trainer.total_steps,
                                         trainer.project_name, trainer.experiment_name,
                                         OmegaConf.to_container(OmegaConf.structured(config)))
        self.kl_controller = algorithms.kl_controller_from_config(config.algorithm.kl_ctrl)
        self.step = 0
        self.skipped_steps = 0  # steps whose sessions all failed (skip_step)
        self.workers: list[Any] = []
        self.placement_group: PlacementGroup | None = None
        self.manager: ServerManager | None = None
        self.runner: AgentLoopRunner | None = None
        self.weight_sync: WeightSyncManager | None = None  # separate_async: actor -> standalone servers
        self.startup.mark("data")

    # ---- start and stop ---------------------------------------------------------------

    async def start(self) -> None:
        """Join (trainer.ray_address / $RAY_ADDRESS) or start Ray, place one hybrid worker
        (actor + rollout engine) per device bundle, rendezvous them, start the balancer; in
        separate_async the balancer's servers are standalone replicas on devices of their own."""
        config = self.config
        n = config.trainer.n_devices
        separate = config.trainer.trainer_mode == "separate_async"
        if not ray.is_initialized():
            placement.init_ray(config)
        self.startup.mark("ray")
        self.placement_group = await placement.reserve_devices(config)
        worker_threads, server_threads = placement.torch_threads(config)
        init_method = await placement.rank0_rendezvous(self.placement_group) if n > 1 else None
        bundle = placement.device_bundle(config)
        self.workers = [HybridWorkerActor.options(**placement.in_bundle(self.placement_group, rank, bundle)).remote(
            config, rank, n, init_method, self.total_optimizer_steps(config.actor.ppo_epochs),
            self.total_optimizer_steps(config.critic.ppo_epochs), worker_threads) for rank in range(n)]
        await asyncio.gather(*(worker.ping.remote() for worker in self.workers))
        self.startup.mark("workers")
        options = ServerOptions(model_path=str(self.model_path), dtype=config.model.dtype,
                                device=config.model.device, torch_threads=server_threads)
        if separate:  # on CPU a device is one core (a Ray bundle of 1 CPU)
            self.manager = await ServerManager.create(config.rollout, options, "standalone")
            self.weight_sync = WeightSyncManager(self.workers, self.manager,
                                                 config.rollout.checkpoint_engine)
        else:
            self.manager = await ServerManager.create(config.rollout, options, "hybrid",
                                                      hosts=self.workers)
        await placement.log_torch_threads(config, self.workers, self.manager)
        self.startup.mark("servers")
        reward_fn = self.rewards.score_one if config.reward.placement == "agent_loop" else None
        self.runner = AgentLoopRunner.from_tokenizer(self.client(), self.tokenizer, config.rollout,
                                                     tools=self.tools, reward_fn=reward_fn)

    @property
    def algorithm_name(self) -> str:
        """GRPO or PPO, for progress bars."""
        return "GRPO" if self.config.algorithm.adv_estimator == "grpo" else "PPO"

    def client(self):
        """The client agent loops use: plain in sync mode; in the async modes the resumable one,
        which finishes requests aborted by a weight sync with the new weights."""
        if self.config.trainer.trainer_mode == "sync":
            return self.manager.client()
        return ResumableClient(self.manager.client())

    async def stop(self) -> None:
        """Stop the agent loops, servers and workers; leave Ray to its owner."""
        if self.runner is not None:
            await self.runner.close()
        if self.manager is not None:
            await self.manager.shutdown()
        for worker in self.workers:
            ray.kill(worker)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.metrics is not None:
            self.metrics.close()

    def total_optimizer_steps(self, epochs: int) -> int:
        """Optimizer steps of the whole run for a role updated `epochs` times per batch (lr schedule)."""
        config = self.config
        trajectories = config.data.train_batch_size * config.rollout.n
        per_step = -(-trajectories // self.mini_batch_trajectories())
        return max(1, config.trainer.total_steps * per_step * epochs)

    # ---- data and generation -----------------------------------------------------------

    def train_rows(self, step: int) -> list[DatasetRow]:
        """The prompts of training step `step` (0-based): deterministic, so resumes replay them."""
        epoch, index = divmod(step, self.steps_per_epoch)
        data = self.config.data
        return self.train_data.batch_at(data.train_batch_size, epoch, index, data.shuffle, data.seed)

    def seeds(self, step: int, count: int, validate: bool) -> list[int]:
        """One deterministic sampling seed per row of batch `step`."""
        base = self.config.trainer.seed * 7_919 + (10**6 if validate else 0) + step * 10_007
        return [(base + i * 104_729) % (1 << 30) for i in range(count)]

    async def generate(self, rows: list[DatasetRow], step: int, validate: bool = False) -> list[Trajectory]:
        """Run the agent loops (n sessions per row) through the client -> trajectories."""
        total = sum(self.runner.sessions_per_prompt(row, validate) for row in rows)
        with progress_bar(total=total, desc="validate" if validate else "generate", unit="traj", leave=False,
                  disable=not self.config.trainer.progress) as bar:
            return await self.runner.run(rows, validate=validate, seeds=self.seeds(step, len(rows), validate),
                                         on_trajectory=lambda _: bar.update())

    async def compute_rewards(self, trajectories: list[Trajectory]) -> None:
        """Colocated order: score trajectories after sampling (reward.placement=after_sampling);
        batched reward functions see them all at once."""
        await self.rewards.score(trajectories)

    # ---- rollout memory and weights ---------------------------------------------------

    async def sleep_rollout(self) -> None:
        """Release the rollout's KV cache and weights while the actor trains (free_cache_engine)."""
        if self.config.rollout.free_cache_engine:
            await self.manager.sleep(["kv_cache", "weights"])

    async def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout in every worker: wake weights, load (version = self.step), wake KV.
        separate_async: the sync manager's cross-process sync into the standalone servers."""
        if self.weight_sync is not None:
            report = await self.weight_sync.sync(self.step)
            if report.behind():
                logger.warning("servers not on version %d after the sync: %s (left out: %s)",
                               self.step, report.behind(), report.left_out)
            return {**report.timings, "time/sync_inner": report.timings["sync/total_s"],
                    "sync/servers_behind": float(len(report.behind()))}
        results = await asyncio.gather(*(w.sync_weights.remote(self.step) for w in self.workers))
        return {"time/sync_inner": max(r["sync/seconds"] for r in results)}

    # ---- the batch and the training phases -----------------------------------------------

    def mini_batch_trajectories(self) -> int:
        """Trajectories per optimizer step: actor.ppo_mini_batch_size prompts x rollout.n."""
        return self.config.actor.ppo_mini_batch_size * self.config.rollout.n

    def make_batch(self, trajectories: list[Trajectory]) -> TensorDict:
        """Jagged batch padded with no-op samples to a multiple of lcm(n_devices, mini-batch),
        ordered so each worker's contiguous shard is token-balanced (batch.balance)."""
        n, mini_batch = self.config.trainer.n_devices, self.mini_batch_trajectories()
        batch = pad_for_data_parallel(trajectories_to_batch(trajectories), n, mini_batch,
                                      self.tokenizer.eos_token_id)
        return balance_batch(batch, n, mini_batch, self.config.actor.share_prompts)

    def _shards(self, batch: TensorDict) -> list[TensorDict]:
        n = len(self.workers)
        fields = [k for k in batch.keys() if k not in ("metadata", "reward_extra", "ground_truth")]
        slim = batch.select(*fields)
        return [shard_batch(slim, rank, n) for rank in range(n)]

    async def _per_worker(self, method: str, batch: TensorDict, *args: Any) -> list[Any]:
        return await asyncio.gather(*(getattr(w, method).remote(shard, *args)
                                      for w, shard in zip(self.workers, self._shards(batch))))

    def _store(self, batch: TensorDict, key: str, flats: list[torch.Tensor]) -> None:
        batch[key] = make_field(torch.cat(flats).float(), field_lengths(batch["responses"]))

    async def compute_old_log_probs(self, batch: TensorDict) -> None:
        """old_log_probs: the actor re-forward, the rollout's own in bypass mode, or nothing yet
        when the update's own forward will give them (strictly on-policy: see update)."""
        if ppo.old_log_probs_from_update(self.config):
            return
        if self.config.algorithm.rollout_correction.bypass_mode:
            old = algorithms.bypass_old_log_probs(field_values(batch["rollout_log_probs"]).float(),
                                                  field_values(batch["response_mask"]))
            batch["old_log_probs"] = make_field(old, field_lengths(batch["responses"]))
            return
        outputs = await self._per_worker("compute_log_prob", batch, True)
        self._store(batch, "old_log_probs", [o["log_probs"] for o in outputs])
        self._store(batch, "entropy", [o["entropy"] for o in outputs])

    async def compute_ref_log_probs(self, batch: TensorDict) -> None:
        """ref_log_prob from the frozen reference (only when a KL term needs it)."""
        if needs_reference(self.config):
            self._store(batch, "ref_log_prob", await self._per_worker("compute_ref_log_prob", batch))

    async def compute_values(self, batch: TensorDict) -> None:
        """Critic values (PPO with GAE only)."""
        if self.config.critic.enable:
            self._store(batch, "values", await self._per_worker("compute_values", batch))

    def compute_advantages(self, batch: TensorDict) -> dict[str, float]:
        """Rollout correction and the gap metrics, then advantages (driver side, whole batch)."""
        metrics = ppo.apply_rollout_correction(batch, self.config)
        metrics.update(ppo.compute_advantages(batch, self.config, self.kl_controller.value))
        if self.config.algorithm.use_kl_in_reward:  # n_steps: the trajectories of this batch
            self.kl_controller.update(metrics["kl_in_reward/kl"], int((~batch["is_padding"]).sum()))
        return metrics

    async def update(self, batch: TensorDict) -> dict[str, float]:
        """Critic then actor updates on every worker's shard. The mini-batch size is global (the
        engine takes its 1/n_devices share); metrics are already reduced over workers."""
        size = self.mini_batch_trajectories()
        metrics: dict[str, float] = {}
        if self.config.critic.enable:
            metrics.update((await self._per_worker("update_critic", batch, size))[0])
        if not ppo.old_log_probs_from_update(self.config):
            metrics.update((await self._per_worker("update_actor", batch, size))[0])
            return metrics
        outputs = await self._per_worker("update_actor_on_policy", batch)
        self._store(batch, "old_log_probs", [o["log_probs"] for o in outputs])
        self._store(batch, "entropy", [o["entropy"] for o in outputs])
        metrics.update(outputs[0]["metrics"])
        metrics.update(ppo.rollout_gap_metrics(batch, self.config))
        return metrics

    async def train_on(self, trajectories: list[Trajectory], timer: PhaseTimer) -> tuple[TensorDict, dict[str, float]]:
        """The training phases every mode shares, in order: reward (after_sampling) ->
        old_log_prob -> ref_log_prob -> values -> advantages -> update. Returns (batch, metrics)."""
        with timer.phase("reward"):
            if self.config.reward.placement == "after_sampling":
                await self.compute_rewards(trajectories)
        batch = self.make_batch(trajectories)
        with timer.phase("old_log_prob"):
            await self.compute_old_log_probs(batch)
        with timer.phase("ref_log_prob"):
            await self.compute_ref_log_probs(batch)
        with timer.phase("values"):
            await self.compute_values(batch)
        with timer.phase("advantages"):
            metrics = self.compute_advantages(batch)
        with timer.phase("update"):
            metrics.update(await self.update(batch))
        return batch, metrics

    # ---- metrics, validation, checkpoints -----------------------------------------------

    def batch_metrics(self, trajectories: list[Trajectory],
                      batches: TensorDict | list[TensorDict]) -> dict[str, float]:
        """Reward, accuracy, lengths and turns of the real (non-padding) samples of the step's
        batch (or mini-batches: separate_async trains several per step)."""
        batches = [batches] if isinstance(batches, TensorDict) else batches
        metrics = _trajectory_metrics(trajectories, "reward")
        sums: dict[str, float] = {"samples": 0.0, "tokens": 0.0, "entropy": 0.0, "kl": 0.0}
        for batch in batches:
            real = drop_padding_samples(batch)
            mask = ppo.dense(real, "response_mask")
            sums["samples"] += mask.shape[0]
            sums["tokens"] += float(mask.sum())
            if "entropy" in real.keys():
                sums["entropy"] += float((ppo.dense(real, "entropy") * mask).sum())
            if "ref_log_prob" in real.keys():
                kl = algorithms.kl_penalty(ppo.dense(real, "old_log_probs"),
                                           ppo.dense(real, "ref_log_prob"), "k1", mask)
                sums["kl"] += float((kl * mask).sum())
            # the worst mini-batch of the step decides the imbalance metrics
            for key, value in token_imbalance(batch, self.config.trainer.n_devices,
                                              self.mini_batch_trajectories()).items():
                metrics[key] = max(metrics.get(key, 0.0), value)
        metrics["response/policy_tokens_mean"] = sums["tokens"] / max(sums["samples"], 1.0)
        if "entropy" in batches[0].keys():
            metrics["actor/entropy"] = sums["entropy"] / max(sums["tokens"], 1.0)
        if "ref_log_prob" in batches[0].keys():
            metrics["actor/ref_kl"] = sums["kl"] / max(sums["tokens"], 1.0)
        return metrics

    async def validate(self) -> dict[str, float]:
        """Every held-out prompt with val_kwargs sampling; reward/accuracy metrics under val/."""
        if self.val_data is None:
            return {}
        rows = [self.val_data[i] for i in range(len(self.val_data))]
        try:
            trajectories = await self.generate(rows, self.step, validate=True)
        except AllSessionsFailed as error:
            logger.warning("validation at step %d: %s; no validation metrics this time",
                           self.step, error)
            return {"val/failed_sessions": float(len(self.runner.take_failures()))}
        if self.config.reward.placement == "after_sampling":
            await self.compute_rewards(trajectories)
        return {**_trajectory_metrics(trajectories, "val"),
                "val/failed_sessions": len(self.runner.take_failures())}

    async def validate_and_report(self, on_validation: ValidationHook | None = None) -> dict[str, float]:
        """validate(), then on_validation(step, metrics) when there was something to validate."""
        metrics = await self.validate()
        if metrics and on_validation is not None:
            on_validation(self.step, metrics)
        return metrics

    async def begin(self, on_validation: ValidationHook | None = None) -> dict[str, float]:
        """Every mode's start: resume (trainer.resume), sync the actor's weights into the rollout,
        validate at step 0 (a resumed run validated its step before it stopped)."""
        if self.config.trainer.resume:
            await self.load_latest_checkpoint()
        await self.sync_weights()
        self.startup.mark("weights")
        validation: dict[str, float] = {}
        if self.step == 0:
            validation = await self.validate_and_report(on_validation)
            if validation:
                self.metrics.log(0, {**validation, **await self.startup_metrics()})
        return validation

    async def end(self, on_validation: ValidationHook | None,
                  validation: dict[str, float]) -> dict[str, float]:
        """Every mode's end: the final validation once total_steps are done; returns the last
        validation metrics (`validation` when the run stopped early)."""
        if self.step >= self.config.trainer.total_steps:
            validation = await self.validate_and_report(on_validation)
            if validation:
                self.metrics.log(self.step, validation)
        return validation

    async def skip_step(self, error: AllSessionsFailed) -> None:
        """A step whose sessions all failed: no update; its prompts count as used, the version
        moves on (the same weights are synced under it, so engines and trainer agree), and the
        step logs rollout/skipped_steps and rollout/failed_sessions."""
        logger.warning("step %d skipped: %s", self.step, error)
        self.skipped_steps += 1
        self.step += 1
        await self.sync_weights()
        self.metrics.log(self.step, {"rollout/skipped_steps": float(self.skipped_steps),
                                     "rollout/failed_sessions": float(len(self.runner.take_failures())),
                                     "weight_version": self.step})

    async def finish_step(self, trajectories: list[Trajectory], batch: TensorDict | list[TensorDict],
                          metrics: dict[str, float], timer: PhaseTimer,
                          on_validation: ValidationHook | None = None) -> dict[str, float]:
        """After the sync: batch and timing metrics, periodic validation and checkpoint, then
        one metrics record for the step. Returns the step's metrics."""
        config = self.config.trainer
        metrics.update(self.batch_metrics(trajectories, batch))
        metrics.update(timer.metrics())
        metrics.update(await self.manager.fault_metrics())  # dead servers, retried requests
        metrics["rollout/failed_sessions"] = len(self.runner.take_failures())  # left out of the batch
        # trajectories whose tokens span a sync: partial rollouts the resumable client finished
        metrics["rollout/cross_version_fraction"] = sum(
            t.min_global_steps != t.max_global_steps for t in trajectories) / max(len(trajectories), 1)
        generated = sum(int(t.response_mask.sum()) for t in trajectories)
        # sync mode: tokens per second of generation; async modes: per second of the whole step
        seconds = timer.times.get("generate") or sum(timer.times.values())
        metrics["throughput/generated_tokens_per_second"] = generated / max(seconds, 1e-9)
        metrics["weight_version"] = self.step
        if config.test_freq and self.step % config.test_freq == 0 and self.step < config.total_steps:
            metrics.update(await self.validate_and_report(on_validation))
        # the last step always keeps the trained model (HF format + tokenizer in .../actor)
        if (config.save_freq and self.step % config.save_freq == 0) or self.step == config.total_steps:
            await self.save_checkpoint()
        metrics.update(await self.startup_metrics())  # once, in the run's first record
        self.metrics.log(self.step, metrics)
        return metrics

    async def startup_metrics(self) -> dict[str, float]:
        """Once, after the first generation: time/startup and its parts, also logged as one
        line (trainer.startup); {} afterwards."""
        if self.startup.reported:
            return {}
        stats = (await self.manager.stats()).values()
        return self.startup.report([s["backend"]["first_token_time"] for s in stats
                                    if s["backend"].get("first_token_time") is not None])

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step}"

    async def save_checkpoint(self) -> Path:
        """Actor/critic state on every worker plus the trainer's own state; `latest` points here
        only once all of it is written and checksummed (non-finite weights are not saved)."""
        directory = self.checkpoint_dir(self.step)
        if directory.exists():
            shutil.rmtree(directory)
        await asyncio.gather(*(w.save_checkpoint.remote(str(directory)) for w in self.workers))
        state = {"step": self.step, "kl_controller": self.kl_controller.state_dict()}
        checkpoint.save_trainer_state(directory, state)
        checkpoint.write_latest(self.output_dir / "checkpoints", self.step)
        return directory

    async def load_latest_checkpoint(self) -> bool:
        """Resume from `latest` if there is one; a training run drops the metrics of later steps
        (they are about to be recomputed), an evaluation leaves them."""
        step = checkpoint.read_latest(self.output_dir / "checkpoints")
        if step is None:
            return False
        directory = self.checkpoint_dir(step)
        state = checkpoint.load_trainer_state(directory)
        await asyncio.gather(*(w.load_checkpoint.remote(str(directory)) for w in self.workers))
        self.step = state["step"]
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        logger.info("resumed from %s (step %d)", directory, self.step)
        return True


def _trajectory_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    real = [t for t in trajectories if not t.is_padding]
    if not real:
        return {}
    count = len(real)
    metrics = {f"{prefix}/mean" if prefix == "reward" else f"{prefix}/reward":
               sum(t.reward or 0.0 for t in real) / count}
    accuracies = [t.reward_extra.get("acc") for t in real if "acc" in t.reward_extra]
    if accuracies:
        metrics[f"{prefix}/acc"] = sum(accuracies) / len(accuracies)
    tools = [t.metadata["tool_calls"] > 0 for t in real if "tool_calls" in t.metadata]
    if tools:
        metrics[f"{prefix}/tool_use"] = sum(tools) / len(tools)
    forked = [t.metadata["forks"] > 0 for t in real if "forks" in t.metadata]
    if forked:  # openai_agent: trajectories of sessions whose history did not extend (re-rendered)
        metrics[f"{prefix}/forked"] = sum(forked) / len(forked)
    metrics[f"{prefix}/failed_rewards"] = float(sum(t.reward_extra.get(FAILED, 0.0) for t in real))
    metrics[f"{prefix}/response_length"] = sum(len(t.responses) for t in real) / count
    metrics[f"{prefix}/num_turns"] = sum(t.num_turns for t in real) / count
    return metrics

