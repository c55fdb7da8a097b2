"""What every trainer mode shares: data, rewards, the phases of a PPO step as named calls,
validation, metrics records and checkpoints. The processes (workers, servers, weight sync) are
the fleet's (fleet.py); the modes (sync.py, ...) decide the order of these calls."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from tandem import algorithms
from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow, PromptDataset
from tandem.agent.prompt_fit import drop_overlong, loop_tool_schemas
from tandem.agent.runner import AgentLoopRunner, AllSessionsFailed
from tandem.batch.balance import balance_batch
from tandem.batch.jagged import field_lengths, field_values, make_field, trajectories_to_batch
from tandem.batch.padding import pad_for_data_parallel
from tandem.batch.trajectory import Trajectory, continued_later, share_split_rewards
from tandem.config.load import to_yaml
from tandem.config.schema import TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.multimodal import image_processor_of
from tandem.progress import progress_bar
from tandem.rewards.scorer import RewardScorer
from tandem.rewards.worker import RewardWorker
from tandem.tools.registry import ToolRegistry
from tandem.training.determinism import seed_everything
from tandem.trainer import ppo
from tandem.fleet.fleet import Fleet
from tandem.fleet.hybrid_worker import needs_reference
from tandem.trainer.metrics import MetricsLogger, PhaseTimer
from tandem.fleet.startup import StartupClock
from tandem.trainer.step_metrics import batch_metrics, rollout_metrics, trajectory_metrics
from tandem.training import checkpoint
from tandem.training.fsdp import shard_batch

logger = logging.getLogger(__name__)

# on_validation(step, metrics): called after each validation (e.g. the demo's report)
ValidationHook = Callable[[int, dict[str, float]], None]


class NoStepTrained(RuntimeError):
    """A run ended without one model update."""


# the native engine's counters logged per step (rollout/<name>, the step's increase): admission,
# and a prefill/decode replica's handoffs (blocks moved, handoffs recomputed, requests moved off
# a lost engine)
ENGINE_COUNTERS = ("admitted", "preemptions", "admission_held_back", "kv_transfer_blocks",
                   "handoffs_recomputed", "replica_requests_moved")
ADMISSION_STATS_TIMEOUT_S = 5.0  # each server's stats() for the step's admission metrics


class RLTrainer:
    """Holds the fleet and the data of one run; `step` is the actor's weight version."""

    def __init__(self, config: TandemConfig, evaluation_only: bool = False,
                 rewards: RewardScorer | None = None, tools: ToolRegistry | None = None) -> None:
        """evaluation_only: read a run's directory without writing to it (tandem eval).
        rewards: the job's reward functions (default: from config.reward); tools: the tool
        registry of the tool loop (default: rollout.multi_turn.tools)."""
        from transformers import AutoTokenizer

        self.startup = StartupClock()  # process start -> first token (time/startup)
        self._engine_counts: dict[str, dict[str, int]] = {}  # server -> counters at last step
        self.startup.mark("trainer")
        self.config = config
        if config.trainer.deterministic:  # the job's own reward or tool code may draw from them
            seed_everything(config.trainer.seed)
        self.model_path = resolve_model_path(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.image_processor = image_processor_of(self.model_path)  # a vision-language policy's
        self.rewards = rewards or RewardScorer.from_config(
            config.reward, prompt_key=config.data.prompt_key, environment=config.rollout.environment)
        if self.rewards.decode is None:  # verl's solution_str: the whole decoded response
            self.rewards.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.tools = tools
        self.train_data = PromptDataset.from_config(config.data, "train")
        self.val_data = PromptDataset.from_config(config.data, "val") if config.data.val_files else None
        if config.data.filter_overlong_prompts:
            self._drop_overlong_prompts()
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
        self.prompt_batch = 0  # the next training prompt batch to draw (next_prompt_batch)
        self.skipped_steps = 0  # steps with nothing to train on (skip_step)
        self.first_skip: str | None = None  # why the first skipped step was skipped
        self.updates = 0  # steps of this process that updated the model
        self.fleet = Fleet(config, self.model_path, self.startup)
        self.runner: AgentLoopRunner | None = None
        self.reward_worker: RewardWorker | None = None  # agent_loop placement with a served reward
        self.startup.mark("data")

    # ---- start and stop ---------------------------------------------------------------

    async def start(self) -> None:
        """Start the fleet (Ray, workers, servers, weight sync, served rewards) and the agent
        loops. With agent_loop placement and a served reward, finished trajectories are scored
        in batches by the reward worker while generation goes on."""
        config = self.config
        await self.fleet.start(self.total_optimizer_steps(config.actor.ppo_epochs),
                               self.total_optimizer_steps(config.critic.ppo_epochs))
        for function in self.fleet.rewards.functions(self.tokenizer):
            self.rewards.add(function)
        reward_fn = None
        if config.reward.placement == "agent_loop":
            reward_fn = self.rewards.score_one
            if self.rewards.served:
                self.reward_worker = RewardWorker(self.rewards)
                reward_fn = self.reward_worker.score_one
        self.runner = AgentLoopRunner.from_tokenizer(self.client(), self.tokenizer, config.rollout,
                                                     tools=self.tools, reward_fn=reward_fn,
                                                     image_processor=self.image_processor)

    @property
    def workers(self) -> list[Any]:
        """The training workers (rank order)."""
        return self.fleet.workers

    @property
    def algorithm_name(self) -> str:
        """GRPO or PPO, for progress bars."""
        return "GRPO" if self.config.algorithm.adv_estimator == "grpo" else "PPO"

    def client(self):
        """The client of the agent loops (the fleet's: resumable in the async modes)."""
        return self.fleet.client()

    async def stop(self) -> None:
        """Stop the agent loops and the fleet; leave Ray to its owner."""
        if self.runner is not None:
            await self.runner.close()
        await self.fleet.stop()
        if self.metrics is not None:
            self.metrics.close()

    def total_optimizer_steps(self, epochs: int) -> int:
        """Optimizer steps of the whole run for a role updated `epochs` times per batch (lr schedule)."""
        config = self.config
        trajectories = config.data.train_batch_size * config.rollout.n
        per_step = -(-trajectories // self.mini_batch_trajectories())
        return max(1, config.trainer.total_steps * per_step * epochs)

    def check_trained(self) -> None:
        """NoStepTrained when this run skipped steps and updated the model in none (no step had
        anything to train on): it must not end like a finished run."""
        if self.skipped_steps and not self.updates:
            raise NoStepTrained(
                f"no step trained: all {self.skipped_steps} step(s) of this run were skipped "
                f"with nothing to train on; the first: {self.first_skip}. Nothing was "
                "trained or saved")

    def _drop_overlong_prompts(self) -> None:
        """data.filter_overlong_prompts: rows the loop would render longer than
        rollout.prompt_length leave both datasets (the preflight logged them)."""
        schemas = loop_tool_schemas(self.config.rollout, self.tools)
        chat_format = ChatFormat(self.tokenizer, image_processor=self.image_processor)
        for dataset in (self.train_data, self.val_data):
            if dataset is not None:
                drop_overlong(dataset, chat_format, schemas, self.config.rollout.prompt_length)

    # ---- data and generation -----------------------------------------------------------

    def train_rows(self, step: int) -> list[DatasetRow]:
        """The prompts of training step `step` (0-based): deterministic, so resumes replay them."""
        epoch, index = divmod(step, self.steps_per_epoch)
        data = self.config.data
        return self.train_data.batch_at(data.train_batch_size, epoch, index, data.shuffle, data.seed)

    def next_prompt_batch(self) -> int:
        """The index of the next batch of training prompts (train_rows), counted on: one per step,
        or more under algorithm.filter_groups; checkpointed, so a resume draws on from there."""
        self.prompt_batch += 1
        return self.prompt_batch - 1

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
        """Colocated order: score trajectories after sampling when reward.placement=
        after_sampling (with agent_loop the loops scored them already); batched reward
        functions see them all at once. A served reward left with no server stops the run
        here, before an update trains on rewards that failed for want of one."""
        if self.config.reward.placement == "after_sampling":
            # scored ones were scored before the group filter (trainer/dynamic_sampling.py)
            await self.rewards.score([t for t in trajectories
                                      if not continued_later(t) and t.reward is None])
            share_split_rewards(trajectories)
        await self.fleet.rewards.check_serving()

    # ---- weights outside a mode (tandem eval / serve) ----------------------------------

    async def sync_weights(self) -> dict[str, float]:
        """Actor -> every engine as version self.step, memory woken around it (the modes spell
        these three phases out themselves)."""
        await self.fleet.wake_rollout(["weights"])
        metrics = await self.fleet.sync_weights(self.step)
        await self.fleet.wake_rollout(["kv_cache"])
        return metrics

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
        """`method` on every worker with its shard, each within trainer.worker_timeout_s."""
        shards = self._shards(batch)
        return await self.fleet.on_workers(method, [(shard, *args) for shard in shards])

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
        """Overlong answers, rollout correction and the gap metrics, then advantages (driver
        side, whole batch)."""
        metrics = ppo.apply_overlong(batch, self.config)
        metrics.update(ppo.apply_rollout_correction(batch, self.config))
        metrics.update(ppo.compute_advantages(batch, self.config, self.kl_controller.value))
        if self.config.algorithm.use_kl_in_reward:  # n_steps: the trajectories of this batch
            self.kl_controller.update(metrics["kl_in_reward/kl"], int((~batch["is_padding"]).sum()))
        return metrics

    async def update(self, batch: TensorDict) -> dict[str, float]:
        """Critic then actor updates on every worker's shard. The mini-batch size is global (the
        engine takes its 1/n_devices share); metrics are already reduced over workers."""
        self.updates += 1
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

    # ---- metrics, validation, checkpoints -----------------------------------------------

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
        await self.compute_rewards(trajectories)
        if self.reward_worker is not None:  # validation's scoring is not the step's overlap
            self.reward_worker.take_busy_seconds()
        return {**trajectory_metrics(trajectories, "val"),
                "val/failed_sessions": len(self.runner.take_failures())}

    async def validate_and_report(self, on_validation: ValidationHook | None = None) -> dict[str, float]:
        """validate(), then on_validation(step, metrics) when there was something to validate."""
        metrics = await self.validate()
        if metrics and on_validation is not None:
            on_validation(self.step, metrics)
        return metrics

    async def validate_first(self, on_validation: ValidationHook | None = None
                             ) -> dict[str, float]:
        """Validation at step 0, logged with the start-up metrics (a resumed run validated its
        step before it stopped); {} otherwise."""
        if self.step != 0:
            return {}
        validation = await self.validate_and_report(on_validation)
        if validation:
            self.metrics.log(0, {**validation, **await self.startup_metrics()})
        return validation

    async def validate_last(self, on_validation: ValidationHook | None,
                            validation: dict[str, float]) -> dict[str, float]:
        """The final validation once total_steps are done; returns the last validation metrics
        (`validation` when the run stopped early)."""
        if self.step >= self.config.trainer.total_steps:
            validation = await self.validate_and_report(on_validation)
            if validation:
                self.metrics.log(self.step, validation)
        return validation

    async def skip_step(self, error: Exception) -> None:
        """A step with nothing to train on (its sessions all failed, AllSessionsFailed, or
        dynamic sampling kept no group, NoGroupKept): no update; its prompts count as used, the version
        moves on (the same weights are synced under it, so engines and trainer agree), and the
        step logs rollout/skipped_steps and rollout/failed_sessions."""
        logger.warning("step %d skipped: %s", self.step, error)
        self.first_skip = self.first_skip or f"step {self.step + 1}: {error}"
        self.skipped_steps += 1
        self.step += 1
        await self.sync_weights()
        self.metrics.log(self.step, {"rollout/skipped_steps": float(self.skipped_steps),
                                     "rollout/failed_sessions": float(len(self.runner.take_failures())),
                                     "weight_version": self.step})

    async def step_record(self, trajectories: list[Trajectory], batches: list[TensorDict],
                          metrics: dict[str, float], timer: PhaseTimer) -> dict[str, float]:
        """The step's metrics record: `metrics` plus batch, timing, rollout and fault metrics,
        the sessions that failed (left out of the batch) and the weight version."""
        config = self.config
        record = dict(metrics)
        record.update(batch_metrics(trajectories, batches, config.trainer.n_devices,
                                    self.mini_batch_trajectories()))
        record.update(timer.metrics())
        record.update(rollout_metrics(trajectories, timer.times))
        record.update(await self.fleet.fault_metrics())  # dead, stalled, restarted servers
        if self.reward_worker is not None:  # scoring that overlapped generation (timeline)
            record["time/reward_overlapped"] = self.reward_worker.take_busy_seconds()
        record["rollout/failed_sessions"] = len(self.runner.take_failures())
        record["weight_version"] = self.step
        return record

    def validation_due(self) -> bool:
        """Whether this step validates (every trainer.test_freq steps, not the last)."""
        config = self.config.trainer
        return bool(config.test_freq) and self.step % config.test_freq == 0 \
            and self.step < config.total_steps

    def checkpoint_due(self) -> bool:
        """Whether this step saves a checkpoint: every trainer.save_freq steps, and always the last
        (the trained model is kept in HF format with its tokenizer in .../actor)."""
        config = self.config.trainer
        return (bool(config.save_freq) and self.step % config.save_freq == 0) \
            or self.step == config.total_steps

    async def log_step(self, record: dict[str, float]) -> None:
        """Write the step's record (with the start-up metrics in the run's first one)."""
        record.update(await self.startup_metrics())
        record.update(await self.engine_metrics())
        self.metrics.log(self.step, record)

    async def engine_metrics(self) -> dict[str, float]:
        """Per step, summed over the engines that count them (the native engine): sessions
        admitted (rollout/admitted), preemptions (rollout/preemptions), steps whose admission
        the KV reserve held back (rollout/admission_held_back), and a PD replica's KV blocks
        moved, handoffs recomputed and requests moved off a lost engine."""
        # a stalled server must not hold the step's record: it is left out after a short wait
        answers = await self.fleet.rollout.control("stats", timeout_s=ADMISSION_STATS_TIMEOUT_S,
                                                   on_error="leave_out")
        totals: dict[str, float] = {}
        for server_id, (stats, *_) in answers.results.items():
            counts = {key: stats["backend"][key] for key in ENGINE_COUNTERS
                      if key in stats["backend"]}
            before = self._engine_counts.get(server_id, {})
            self._engine_counts[server_id] = counts
            for key, value in counts.items():  # a restarted server counts from 0 again
                totals[key] = totals.get(key, 0.0) + max(0, value - before.get(key, 0))
        return {f"rollout/{key}": value for key, value in totals.items()}

    async def startup_metrics(self) -> dict[str, float]:
        """Once, after the first generation: time/startup and its parts, also logged as one
        line (trainer.startup), and rollout/engine_ranks (the ranks of every replica, a
        tensor-parallel one counting each); {} afterwards."""
        if self.startup.reported:
            return {}
        stats = list((await self.fleet.rollout.stats()).values())
        ranks = sum(s["backend"].get("tensor_parallel_ranks", 1) for s in stats)
        return {**self.startup.report([s["backend"]["first_token_time"] for s in stats
                                       if s["backend"].get("first_token_time") is not None]),
                "rollout/engine_ranks": float(ranks)}

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step}"

    async def save_checkpoint(self) -> Path:
        """Actor/critic state on every worker plus the trainer's own state; `latest` points here
        only once all of it is written and checksummed (non-finite weights are not saved)."""
        directory = self.checkpoint_dir(self.step)
        if directory.exists():
            shutil.rmtree(directory)
        await self.fleet.on_workers("save_checkpoint", [(str(directory),)] * len(self.workers))
        state = {"step": self.step, "prompt_batch": self.prompt_batch, "kl_controller": self.kl_controller.state_dict()}
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
        await self.fleet.on_workers("load_checkpoint", [(str(directory),)] * len(self.workers))
        self.step = state["step"]
        self.prompt_batch = state.get("prompt_batch", self.step)  # checkpoints before filter_groups
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        logger.info("resumed from %s (step %d)", directory, self.step)
        return True
