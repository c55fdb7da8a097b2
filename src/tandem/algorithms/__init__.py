"""Pure functions of RL post-training: advantages, losses, KL, aggregation, rollout correction.

Inputs are dense response-aligned tensors [B, T] with a 0/1 mask, or per-trajectory [B] scalars
with group ids. See docs/algorithms.md for the formulas and the choices made.
"""

from tandem.algorithms.advantages import gae_advantage, group_index, group_normalize, grpo_outcome_advantage
from tandem.algorithms.aggregation import aggregate_loss, loss_normalizers
from tandem.algorithms.entropy import entropy_bonus, entropy_from_logits
from tandem.algorithms.group_filter import groups_with_signal
from tandem.algorithms.kl import kl_in_reward, kl_loss, kl_penalty, resolve_kl_type
from tandem.algorithms.kl_control import AdaptiveKLController, FixedKLController, kl_controller_from_config
from tandem.algorithms.masked import (masked_count, masked_max, masked_mean, masked_sum, masked_var,
                                      masked_whiten)
from tandem.algorithms.metrics import logprob_gap_metrics, policy_metrics
from tandem.algorithms.overlong import keep_untruncated, overlong_penalty
from tandem.algorithms.policy_loss import PolicyLossOutput, ppo_clip_loss
from tandem.algorithms.rejection import RejectionCriterion, parse_rejection, rejection_keep
from tandem.algorithms.rollout_correction import (RolloutCorrection, batch_normalize_weights,
                                                  bypass_old_log_probs, icepop_importance_weights,
                                                  rejection_mask, rollout_correction,
                                                  truncated_importance_weights)
from tandem.algorithms.value_loss import clipped_value_loss

__all__ = [
    "AdaptiveKLController", "FixedKLController", "PolicyLossOutput", "RejectionCriterion",
    "RolloutCorrection", "aggregate_loss", "batch_normalize_weights", "bypass_old_log_probs",
    "clipped_value_loss", "entropy_bonus", "entropy_from_logits", "gae_advantage",
    "group_index", "group_normalize", "groups_with_signal", "grpo_outcome_advantage", "icepop_importance_weights",
    "keep_untruncated", "kl_controller_from_config", "kl_in_reward", "kl_loss", "kl_penalty",
    "logprob_gap_metrics", "overlong_penalty",
    "loss_normalizers", "masked_count", "masked_max", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten", "parse_rejection", "policy_metrics", "ppo_clip_loss", "rejection_keep",
    "rejection_mask", "resolve_kl_type", "rollout_correction", "truncated_importance_weights",
]
