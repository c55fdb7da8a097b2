"""The PPO/GRPO glue between a jagged batch and the pure functions of tandem.algorithms.

Batch fields read and written here (all [B, R_i] response-aligned unless noted): responses,
response_mask, loss_mask, rollout_log_probs, reward [B], uid (non-tensor), old_log_probs,
ref_log_prob, values, advantages, returns, importance_weights.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tandem import algorithms
from tandem.batch.jagged import field_lengths, make_field, non_tensor_list
from tandem.config.schema import TandemConfig
from tandem.training.losses import dense


def set_dense(batch: TensorDict, key: str, values: torch.Tensor) -> None:
    """Store [B, R_max] values as a response-aligned field, cut back to each R_i."""
    lengths = field_lengths(batch["responses"])
    flat = torch.cat([values[i, : int(n)] for i, n in enumerate(lengths)])
    batch[key] = make_field(flat, lengths)


def token_level_scores(batch: TensorDict) -> torch.Tensor:
    """The outcome reward placed on each trajectory's last policy token: [B, R_max]."""
    mask = dense(batch, "response_mask")
    scores = torch.zeros_like(mask)
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(dim=1)
    has_token = mask.sum(dim=1) > 0
    scores[has_token, last[has_token]] = batch["reward"].float()[has_token]
    return scores


def compute_advantages(batch: TensorDict, config: TandemConfig, kl_coef: float = 0.0) -> dict[str, float]:
    """Fill batch["advantages"] (and "returns" for GAE); KL-in-reward when configured."""
    mask = dense(batch, "response_mask")
    scores = token_level_scores(batch)
    metrics: dict[str, float] = {}
    if config.algorithm.use_kl_in_reward:
        scores, current_kl = algorithms.kl_in_reward(scores, dense(batch, "old_log_probs"),
                                                     dense(batch, "ref_log_prob"), mask, kl_coef,
                                                     config.algorithm.kl_penalty)
        metrics.update({"kl_in_reward/kl": float(current_kl), "kl_in_reward/coef": kl_coef})
    if config.algorithm.adv_estimator == "grpo":
        advantages = algorithms.grpo_outcome_advantage(
            scores.sum(dim=1), mask, non_tensor_list(batch, "uid"),
            norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo)
    else:
        advantages, returns = algorithms.gae_advantage(scores, dense(batch, "values"), mask,
                                                       config.algorithm.gamma, config.algorithm.lam)
        set_dense(batch, "returns", returns)
    set_dense(batch, "advantages", advantages)
    metrics["advantages/abs_mean"] = float(algorithms.masked_mean(advantages.abs(), mask))
    return metrics


def old_log_probs_from_update(config: TandemConfig) -> bool:
    """True when each batch is consumed strictly on-policy (one epoch, one mini-batch, one device)
    and nothing needs old_log_probs before the update (no KL in reward, no rollout correction,
    no bypass): the update's own forward then gives them (TrainingEngine.update_on_policy)."""
    correction = config.algorithm.rollout_correction
    return (config.actor.ppo_epochs == 1 and config.data.train_batch_size <= config.actor.ppo_mini_batch_size
            and config.trainer.n_devices == 1 and not config.algorithm.use_kl_in_reward
            and correction.importance_sampling == "none" and correction.rejection == "none"
            and not correction.bypass_mode)


def rollout_gap_metrics(batch: TensorDict, config: TandemConfig) -> dict[str, float]:
    """Rollout-engine vs actor log-prob gap (rollout_gap/*), when the rollout returned log-probs."""
    if not config.rollout.calculate_log_probs:
        return {}
    return algorithms.logprob_gap_metrics(dense(batch, "rollout_log_probs"), dense(batch, "old_log_probs"),
                                          dense(batch, "response_mask"))


def apply_overlong(batch: TensorDict, config: TandemConfig) -> dict[str, float]:
    """algorithm.overlong on the batch: the soft length penalty added to each answer's reward,
    truncated answers (stop_reason length) out of loss_mask; their share and the mean penalty."""
    overlong = config.algorithm.overlong
    real = ~batch["is_padding"]
    truncated = torch.tensor([reason == "length" for reason in non_tensor_list(batch, "stop_reason")])
    truncated &= real
    metrics = {"overlong/truncated_fraction": float(truncated.sum()) / max(1, int(real.sum()))}
    if overlong.buffer_len:
        penalty = algorithms.overlong_penalty(field_lengths(batch["responses"]),
                                              config.rollout.response_length, overlong.buffer_len,
                                              overlong.penalty_factor) * real
        batch["reward"] = batch["reward"].float() + penalty
        metrics["overlong/penalty_mean"] = float(penalty.sum()) / max(1, int(real.sum()))
    if overlong.filter:
        set_dense(batch, "loss_mask", algorithms.keep_untruncated(truncated, dense(batch, "loss_mask")))
    return metrics


def apply_rollout_correction(batch: TensorDict, config: TandemConfig) -> dict[str, float]:
    """Compare rollout and actor log-probs; set importance_weights and the corrected loss_mask.
    Without rollout log-probs (rollout.calculate_log_probs=false) there is nothing to compare;
    when old_log_probs come from the update, its gap metrics come after it (rollout_gap_metrics)."""
    if not config.rollout.calculate_log_probs or old_log_probs_from_update(config):
        return {}
    correction_config = config.algorithm.rollout_correction
    mask = dense(batch, "response_mask")
    rollout, old = dense(batch, "rollout_log_probs"), dense(batch, "old_log_probs")
    metrics = rollout_gap_metrics(batch, config)
    correction = algorithms.rollout_correction(old, rollout, mask, correction_config)
    set_dense(batch, "loss_mask", correction.loss_mask.float() * dense(batch, "loss_mask"))
    if correction.weights is not None:
        set_dense(batch, "importance_weights", correction.weights)
    metrics.update(correction.metrics)
    return metrics
