"""The served rewards of a run (reward.model, reward.judge): the fleet starts them on reward
pools of their own (n_devices > 0) or on the training workers' bundles (n_devices = 0), and
hands the scorer one weighted reward function per served model. With rollout.fault_tolerance the
fleet's health check restarts their servers (pools()); without, a pool that lost its last
server stops the run (check_serving) instead of failing every later sample's reward."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray.util.placement_group import PlacementGroup

from tandem.config.schema import RewardJudgeConfig, RolloutConfig, TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.rewards.scorer import RewardFunction
from tandem.rewards.served import JudgeReward, RewardModelReward, same_tokenizer
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.remote import call
from tandem.serving.reward_pool import RewardModelPool
from tandem.fleet.rollout_pool import RolloutPool


class ServedRewardLost(RuntimeError):
    """A served reward has no server left and none is being restarted."""


def judge_rollout_config(judge: RewardJudgeConfig) -> RolloutConfig:
    """The native engine's settings for the judge: greedy verdicts of max_new_tokens."""
    return RolloutConfig(name="native", prompt_length=judge.prompt_length,
                         response_length=judge.max_new_tokens, n=1, calculate_log_probs=False,
                         kv_cache_memory_bytes=judge.kv_cache_memory_bytes,
                         nnodes=1 if judge.n_devices else 0, n_gpus_per_node=judge.n_devices,
                         torch_threads=judge.torch_threads)


class ServedRewards:
    """The reward-model pool and the judge's server manager of one run (either may be None)."""

    def __init__(self, config: TandemConfig) -> None:
        self.config = config
        self.reward_model: RewardModelPool | None = None
        self.judge: ServerManager | None = None
        self.judge_pool: RolloutPool | None = None  # the judge's replicas, for restarts
        self.paths: dict[str, Path] = {}

    async def start(self, training_group: PlacementGroup | None) -> None:
        """Start what reward.model / reward.judge enable, each within trainer.timeout_s."""
        reward, model = self.config.reward, self.config.model
        timeout_s = self.config.trainer.timeout_s
        if reward.model.enable:
            self.paths["model"] = resolve_model_path(reward.model.path)
            self.reward_model = await RewardModelPool.create(
                str(self.paths["model"]), reward.model, model.dtype, model.device,
                training_group, timeout_s)
        if reward.judge.enable:
            judge = reward.judge
            self.paths["judge"] = resolve_model_path(judge.path)
            cuda = model.device.startswith("cuda")
            options = ServerOptions(model_path=str(self.paths["judge"]), dtype=model.dtype,
                                    device=model.device, torch_threads=judge.torch_threads,
                                    device_bundle=None if cuda else {"CPU": float(judge.torch_threads)},
                                    start_timeout_s=timeout_s, control_timeout_s=timeout_s)
            rollout = judge_rollout_config(judge)
            if judge.n_devices:
                self.judge = await ServerManager.create(rollout, options, "standalone")
            else:  # the training worker holds the whole bundle: share its core unreserved
                options.colocated_fraction = 0.0
                self.judge = await ServerManager.create(
                    dataclasses.replace(rollout, nnodes=0, n_gpus_per_node=0), options,
                    "colocated", placement_group=training_group, bundle_indices=[0])
            self.judge_pool = RolloutPool("judge", self.judge, None)

    def pools(self) -> list:
        """The pools the fleet's health check restarts servers of."""
        return [pool for pool in (self.reward_model, self.judge_pool) if pool is not None]

    async def check_serving(self) -> None:
        """ServedRewardLost when a served reward has no server left and none is restarting
        (rollout.fault_tolerance off, or a pool of one): every later sample would fail its
        reward while the run went on."""
        for pool in self.pools():
            status = await call(pool.balancer, "status")
            if not status.servers and not status.expected:
                lost = ", ".join([*(f"{sid} died" for sid in status.dead_servers),
                                  *(f"{sid} stalled" for sid in status.stalled_servers)])
                field = "reward.model" if pool.name == "reward_model" else "reward.judge"
                raise ServedRewardLost(
                    f"{field}: no {pool.name} server is left ({lost or 'all removed'}), so every "
                    "later sample would fail its reward; the run stops. Set "
                    "rollout.fault_tolerance.enable=true to restart them, or give it more "
                    f"servers ({field}.n_devices)")

    def functions(self, policy_tokenizer: Any) -> list[RewardFunction]:
        """One weighted "served" reward function per started model."""
        from transformers import AutoTokenizer

        reward, functions = self.config.reward, []
        if self.reward_model is not None:
            tokenizer = AutoTokenizer.from_pretrained(self.paths["model"])
            scorer = RewardModelReward(self.reward_model.client(self.config.trainer.timeout_s),
                                       None if same_tokenizer(policy_tokenizer, tokenizer) else tokenizer)
            functions.append(RewardFunction(scorer.name, scorer, "served", reward.model.weight))
        if self.judge is not None:
            judge = reward.judge
            scorer = JudgeReward(self.judge.client(self.config.trainer.timeout_s),
                                 AutoTokenizer.from_pretrained(self.paths["judge"]),
                                 judge.prompt_template, judge.verdict_pattern, judge.score_scale,
                                 judge.max_new_tokens, judge.prompt_length)
            functions.append(RewardFunction(scorer.name, scorer, "served", judge.weight))
        return functions

    async def fault_metrics(self) -> dict[str, float]:
        """Dead and stalled servers (found by clients or the health check) and retried calls of
        the judge and the reward model."""
        metrics: dict[str, float] = {}
        for pool in self.pools():
            status = await call(pool.balancer, "status")
            metrics[f"serving/{pool.name}_dead_servers"] = float(len(status.dead_servers))
            metrics[f"serving/{pool.name}_stalled_servers"] = float(len(status.stalled_servers))
            metrics[f"serving/{pool.name}_retried_requests"] = float(status.retried_requests)
        return metrics

    async def stop(self) -> None:
        """Stop the reward servers and the judge."""
        if self.reward_model is not None:
            await self.reward_model.shutdown()
            self.reward_model = None
        if self.judge is not None:
            await self.judge_pool.stop()
            await self.judge.shutdown()
            self.judge, self.judge_pool = None, None
