"""What every trainer mode shares: Ray workers and servers, data, rewards, the phases of a PPO
step as named calls, validation, metrics and checkpoints. The modes (sync.py, ...) only decide
the order of these calls."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDict
from tqdm import tqdm

from tandem import algorithms
from tandem.agent.dataset import DatasetRow, PromptDataset
from tandem.agent.runner import AgentLoopRunner
from tandem.batch.jagged import field_lengths, field_values, make_field, trajectories_to_batch
from tandem.batch.padding import drop_padding_samples, pad_to_multiple
from tandem.batch.trajectory import Trajectory
from tandem.config.load import to_yaml
from tandem.config.schema import TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.rewards import compute_reward
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.trainer import ppo
from tandem.trainer.hybrid_worker import HybridWorkerActor, needs_reference
from tandem.trainer.metrics import MetricsLogger
from tandem.training.fsdp import shard_batch

logger = logging.getLogger(__name__)


class RLTrainer:
    """Holds the workers, servers and data of one run; `step` is the actor's weight version."""

    def __init__(self, config: TandemConfig, evaluation_only: bool = False) -> None:
        """evaluation_only: read a run's directory without writing to it (tandem eval)."""
        from transformers import AutoTokenizer

        if config.trainer.trainer_mode != "sync":
            raise ValueError(f"trainer.trainer_mode={config.trainer.trainer_mode!r}: only the sync loop "
                             "exists so far (colocate_async and separate_async are planned); set "
                             "trainer.trainer_mode=sync")
        self.config = config
        self.evaluation_only = evaluation_only
        self.model_path = resolve_model_path(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
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
            self.metrics = MetricsLogger(self.output_dir, config.trainer.tensorboard)
        self.kl_controller = algorithms.kl_controller_from_config(config.algorithm.kl_ctrl)
        self.step = 0
        self.workers: list[Any] = []
        self.manager: ServerManager | None = None
        self.runner: AgentLoopRunner | None = None

    # ---- start and stop ---------------------------------------------------------------

    async def start(self) -> None:
        """Start Ray, the hybrid workers (actor + rollout engine each) and the balancer."""
        config = self.config
        n = config.trainer.n_devices
        if not ray.is_initialized():
            ray.init(num_cpus=max(os.cpu_count() or 1, n), include_dashboard=False,
                     log_to_driver=True, _system_config={"worker_niceness": 0})
        threads = max(1, (os.cpu_count() or 1) // n)
        init_method = f"tcp://127.0.0.1:{_free_port()}" if n > 1 else None
        self.workers = [HybridWorkerActor.options(num_cpus=0).remote(
            config, rank, n, init_method, self.total_optimizer_steps(config.actor.ppo_epochs),
            self.total_optimizer_steps(config.critic.ppo_epochs), threads) for rank in range(n)]
        await asyncio.gather(*(worker.ping.remote() for worker in self.workers))
        options = ServerOptions(model_path=str(self.model_path), dtype=config.model.dtype,
                                device=config.model.device)
        self.manager = await ServerManager.create(config.rollout, options, "hybrid", hosts=self.workers)
        reward_fn = self._reward_fn if config.reward.placement == "agent_loop" else None
        self.runner = AgentLoopRunner.from_tokenizer(self.client(), self.tokenizer, config.rollout,
                                                     reward_fn=reward_fn)

    def client(self):
        """The client agent loops use (sync mode: plain; async modes override with resumable)."""
        return self.manager.client()

    async def stop(self) -> None:
        """Stop servers and workers; leave Ray to its owner."""
        if self.manager is not None:
            await self.manager.shutdown()
        for worker in self.workers:
            ray.kill(worker)
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

    def _seeds(self, step: int, count: int, validate: bool) -> list[int]:
        base = self.config.trainer.seed * 7_919 + (10**6 if validate else 0) + step * 10_007
        return [(base + i * 104_729) % (1 << 30) for i in range(count)]

    async def generate(self, rows: list[DatasetRow], step: int, validate: bool = False) -> list[Trajectory]:
        """Run the agent loops (n sessions per row) through the client -> trajectories."""
        total = sum(self.runner.sessions_per_prompt(row, validate) for row in rows)
        with tqdm(total=total, desc="validate" if validate else "generate", unit="traj", leave=False,
                  disable=not self.config.trainer.progress) as bar:
            return await self.runner.run(rows, validate=validate, seeds=self._seeds(step, len(rows), validate),
                                         on_trajectory=lambda _: bar.update())

    def _reward_fn(self, trajectory: Trajectory, row: DatasetRow | None = None) -> tuple[float, dict]:
        result = compute_reward(trajectory.data_source, trajectory.metadata["response_text"],
                                trajectory.ground_truth, trajectory.metadata.get("extra_info") or {})
        return result.score, result.extra

    def compute_rewards(self, trajectories: list[Trajectory]) -> None:
        """Colocated order: score trajectories after sampling (reward.placement=after_sampling)."""
        for trajectory in trajectories:
            trajectory.reward, trajectory.reward_extra = self._reward_fn(trajectory)

    # ---- rollout memory and weights ---------------------------------------------------

    async def sleep_rollout(self) -> None:
        """Release the rollout's KV cache and weights while the actor trains (free_cache_engine)."""
        if self.config.rollout.free_cache_engine:
            await self.manager.sleep(["kv_cache", "weights"])

    async def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout in every worker: wake weights, load (version = self.step), wake KV."""
        results = await asyncio.gather(*(w.sync_weights.remote(self.step) for w in self.workers))
        return {"time/sync_inner": max(r["sync/seconds"] for r in results)}

    # ---- the batch and the training phases -----------------------------------------------

    def mini_batch_trajectories(self) -> int:
        """Trajectories per optimizer step: actor.ppo_mini_batch_size prompts x rollout.n."""
        return self.config.actor.ppo_mini_batch_size * self.config.rollout.n

    def make_batch(self, trajectories: list[Trajectory]) -> TensorDict:
        """Jagged batch padded with no-op samples to a multiple of n_devices x mini-batch."""
        batch = trajectories_to_batch(trajectories)
        multiple = self.config.trainer.n_devices * self.mini_batch_trajectories()
        return pad_to_multiple(batch, multiple, self.tokenizer.eos_token_id)

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

    # ---- metrics, validation, checkpoints -----------------------------------------------

    def batch_metrics(self, trajectories: list[Trajectory], batch: TensorDict) -> dict[str, float]:
        """Reward, accuracy, lengths and turns of the real (non-padding) samples."""
        real = drop_padding_samples(batch)
        mask = ppo.dense(real, "response_mask")
        metrics = _trajectory_metrics(trajectories, "reward")
        metrics["response/policy_tokens_mean"] = float(mask.sum(1).mean())
        if "entropy" in real.keys():
            metrics["actor/entropy"] = float(algorithms.masked_mean(ppo.dense(real, "entropy"), mask))
        if "ref_log_prob" in real.keys():
            kl = algorithms.kl_penalty(ppo.dense(real, "old_log_probs"), ppo.dense(real, "ref_log_prob"), "k1", mask)
            metrics["actor/ref_kl"] = float(algorithms.masked_mean(kl, mask))
        return metrics

    async def validate(self) -> dict[str, float]:
        """Every held-out prompt with val_kwargs sampling; reward/accuracy metrics under val/."""
        if self.val_data is None:
            return {}
        rows = [self.val_data[i] for i in range(len(self.val_data))]
        trajectories = await self.generate(rows, self.step, validate=True)
        if self.config.reward.placement == "after_sampling":
            self.compute_rewards(trajectories)
        return _trajectory_metrics(trajectories, "val")

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step}"

    async def save_checkpoint(self) -> Path:
        """Actor/critic state on every worker plus the trainer's own state; `latest` points here."""
        directory = self.checkpoint_dir(self.step)
        if directory.exists():
            shutil.rmtree(directory)
        await asyncio.gather(*(w.save_checkpoint.remote(str(directory)) for w in self.workers))
        state = {"step": self.step, "kl_controller": self.kl_controller.state_dict()}
        (directory / "trainer_state.json").write_text(json.dumps(state))
        (self.output_dir / "checkpoints" / "latest").write_text(str(self.step))
        return directory

    async def load_latest_checkpoint(self) -> bool:
        """Resume from `latest` if there is one; a training run drops the metrics of later steps
        (they are about to be recomputed), an evaluation leaves them."""
        latest = self.output_dir / "checkpoints" / "latest"
        if not latest.exists():
            return False
        directory = self.checkpoint_dir(int(latest.read_text()))
        await asyncio.gather(*(w.load_checkpoint.remote(str(directory)) for w in self.workers))
        state = json.loads((directory / "trainer_state.json").read_text())
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
    metrics[f"{prefix}/response_length"] = sum(len(t.responses) for t in real) / count
    metrics[f"{prefix}/num_turns"] = sum(t.num_turns for t in real) / count
    return metrics


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
