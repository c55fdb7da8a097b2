"""Per-step metrics over masked-in tokens; padding samples and masked tokens count exactly 0."""

from __future__ import annotations

import torch

from tandem.algorithms.masked import masked_max, masked_mean, require_same_shape
from tandem.algorithms.policy_loss import PolicyLossOutput


@torch.no_grad()
def logprob_gap_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                        response_mask: torch.Tensor) -> dict[str, float]:
    """Rollout-engine vs training-actor log-prob gap over masked-in tokens of [B, T].

    With d = old - rollout: abs_diff_mean = mean|d|, abs_diff_max = max|d|, and two estimates of
    KL(pi_rollout || pi_old) from the rollout's own samples: kl_k1 = mean(-d) and
    kl_k3 = mean(exp(d) - d - 1) (never negative).
    """
    require_same_shape(rollout_log_probs=rollout_log_probs, old_log_probs=old_log_probs,
                       response_mask=response_mask)
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
    difference = torch.where(mask, old_log_probs.float() - rollout_log_probs.float(), zero.float())
    k3 = torch.exp(difference.clamp(max=20.0)) - difference - 1
    return {
        "rollout_gap/abs_diff_mean": float(masked_mean(difference.abs(), mask)),
        "rollout_gap/abs_diff_max": float(masked_max(difference.abs(), mask)),
        "rollout_gap/kl_k1": float(masked_mean(-difference, mask)),
        "rollout_gap/kl_k3": float(masked_mean(k3, mask)),
    }


@torch.no_grad()
def policy_metrics(policy_loss: PolicyLossOutput, response_mask: torch.Tensor,
                   kl: torch.Tensor | None = None,
                   entropy: torch.Tensor | None = None) -> dict[str, float]:
    """Clip fractions and ppo_kl of a PPO loss, plus the masked means of kl [B, T] and entropy [B, T]."""
    metrics = {
        "policy/clip_fraction_upper": float(policy_loss.clip_fraction_upper),
        "policy/clip_fraction_lower": float(policy_loss.clip_fraction_lower),
        "policy/clip_fraction_dual": float(policy_loss.clip_fraction_dual),
        "policy/ppo_kl": float(policy_loss.ppo_kl),
    }
    if kl is not None:
        metrics["policy/kl_mean"] = float(masked_mean(kl.float(), response_mask))
    if entropy is not None:
        metrics["policy/entropy_mean"] = float(masked_mean(entropy.float(), response_mask))
    return metrics
