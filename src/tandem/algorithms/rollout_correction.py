"""Off-policy correction between the rollout engine (behaviour) and the training actor.

The per-token log-ratio is old_log_probs - rollout_log_probs (log pi_old / pi_rollout); the
sequence log-ratio is its sum over the masked-in tokens (log of the product of token ratios).
Everything here is detached: weights scale the loss, masks drop tokens, no gradient flows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.algorithms.masked import masked_mean, masked_sum, require_same_shape
from tandem.config.load import CORRECTION_LEVELS
from tandem.config.schema import RolloutCorrectionConfig


@dataclass
class RolloutCorrection:
    """weights [B, T] (TIS, 0 where masked; None without importance sampling), loss_mask [B, T]
    (response_mask minus rejected tokens, bool) and scalar metrics."""

    weights: torch.Tensor | None
    loss_mask: torch.Tensor
    metrics: dict[str, float]


def _log_ratios(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log-ratios [B, T], or each sequence's summed log-ratio broadcast over [B, T]."""
    require_same_shape(old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs,
                       response_mask=response_mask)
    if level not in CORRECTION_LEVELS or level == "none":
        raise ValueError(f"unknown correction level {level!r}; use token or sequence")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
    log_ratio = torch.where(mask, (old_log_probs - rollout_log_probs).detach(), zero)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    return log_ratio


def truncated_importance_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                                 response_mask: torch.Tensor, level: str = "token",
                                 threshold: float = 2.0) -> torch.Tensor:
    """TIS weights [B, T]: min(pi_old / pi_rollout, threshold) per token or per sequence
    (the sequence weight on each of its tokens); 0 where masked, detached."""
    if threshold <= 0:
        raise ValueError(f"importance_sampling_threshold is {threshold}; it must be > 0")
    log_ratio = _log_ratios(old_log_probs, rollout_log_probs, response_mask, level)
    # Truncating in log space keeps exp() finite for long sequences.
    weights = torch.exp(log_ratio.clamp(max=math.log(threshold)))
    return torch.where(response_mask.bool(), weights, torch.zeros((), dtype=weights.dtype,
                                                                 device=weights.device))


def rejection_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, level: str = "token", low: float = 0.5,
                   high: float = 2.0) -> torch.Tensor:
    """IcePop-style keep mask [B, T] (bool): masked-in tokens whose token (or sequence) ratio
    pi_old / pi_rollout lies in [low, high]; everything else False."""
    if not 0 < low <= high:
        raise ValueError(f"rejection bounds must satisfy 0 < rejection_low <= rejection_high; "
                         f"got {low}, {high}")
    log_ratio = _log_ratios(old_log_probs, rollout_log_probs, response_mask, level)
    inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    return response_mask.bool() & inside


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """Apply algorithm.rollout_correction to one batch of [B, T] tensors.

    The caller multiplies the per-token loss by `weights` and aggregates with `loss_mask`.
    Metrics are over masked-in tokens and non-empty sequences of response_mask.
    """
    mask = response_mask.bool()
    keep = mask
    weights = None
    metrics: dict[str, float] = {}
    if config.rejection != "none":
        keep = rejection_mask(old_log_probs, rollout_log_probs, mask, config.rejection,
                              config.rejection_low, config.rejection_high)
        rejected = mask & ~keep
        sequences = mask.any(dim=-1)
        metrics["rollout_correction/rejected_token_fraction"] = float(
            masked_mean(rejected.float(), mask))
        metrics["rollout_correction/rejected_sequence_fraction"] = float(
            masked_mean((sequences & ~keep.any(dim=-1)).float(), sequences))
    if config.importance_sampling != "none":
        weights = truncated_importance_weights(old_log_probs, rollout_log_probs, mask,
                                               config.importance_sampling,
                                               config.importance_sampling_threshold)
        log_ratio = _log_ratios(old_log_probs, rollout_log_probs, mask, config.importance_sampling)
        truncated = log_ratio > math.log(config.importance_sampling_threshold)
        metrics["rollout_correction/weight_mean"] = float(masked_mean(weights, keep))
        metrics["rollout_correction/truncated_fraction"] = float(
            masked_mean(truncated.float(), keep))
    return RolloutCorrection(weights=weights, loss_mask=keep, metrics=metrics)


def bypass_old_log_probs(rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Bypass mode: old_log_probs [B, T] = rollout_log_probs (detached copy, 0 where masked).

    The actor re-forward is skipped, so PPO's ratio is pi_theta / pi_rollout directly.
    """
    require_same_shape(rollout_log_probs=rollout_log_probs, response_mask=response_mask)
    return torch.where(response_mask.bool(), rollout_log_probs.detach(),
                       torch.zeros((), dtype=rollout_log_probs.dtype, device=rollout_log_probs.device))
