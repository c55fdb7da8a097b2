"""Off-policy correction between the rollout engine (behaviour) and the training actor.

The per-token log-ratio is old_log_probs - rollout_log_probs (log pi_old / pi_rollout); the
sequence log-ratio is its sum over the masked-in tokens (log of the product of token ratios).
Importance weights are truncated (TIS) or IcePop (zero outside bounds), optionally normalised
to batch mean 1; rejection criteria live in rejection.py. Everything here is detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.algorithms.masked import masked_mean, masked_sum, require_same_shape
from tandem.algorithms.rejection import LOG_RATIO_LIMIT, parse_rejection, rejection_keep
from tandem.config.choices import CORRECTION_LEVELS
from tandem.config.schema import RolloutCorrectionConfig


@dataclass
class RolloutCorrection:
    """weights [B, T] (importance weights, 0 where masked; None without importance sampling),
    loss_mask [B, T] (response_mask minus rejected tokens, bool) and scalar metrics."""

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
    weights = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, math.log(threshold)))
    return torch.where(response_mask.bool(), weights, torch.zeros((), dtype=weights.dtype,
                                                                 device=weights.device))


def icepop_importance_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                              response_mask: torch.Tensor, level: str = "token", low: float = 0.5,
                              high: float = 2.0) -> torch.Tensor:
    """IcePop weights [B, T]: the ratio pi_old / pi_rollout (token or sequence) where it lies in
    [low, high], 0 outside it and where masked; detached."""
    if not 0 < low <= high:
        raise ValueError(f"icepop bounds must satisfy 0 < importance_sampling_low <= "
                         f"importance_sampling_threshold; got {low}, {high}")
    log_ratio = _log_ratios(old_log_probs, rollout_log_probs, response_mask, level)
    inside = response_mask.bool() & (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    return torch.where(inside, torch.exp(log_ratio.clamp(math.log(low), math.log(high))),
                       torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))


def batch_normalize_weights(weights: torch.Tensor, response_mask: torch.Tensor,
                            level: str = "token") -> tuple[torch.Tensor, float]:
    """(weights / mean, mean): the mean over masked-in tokens (token level) or over non-empty
    sequences' weights (sequence level); unchanged when the mean is below 1e-8."""
    mask = response_mask.bool()
    if level == "token":
        mean = masked_mean(weights, mask)
    else:
        mean = masked_mean(masked_mean(weights, mask, dim=-1), mask.any(dim=-1))
    if float(mean) <= 1e-8:
        return weights, 1.0
    return weights / mean, float(mean)


def rejection_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, rejection: str = "token", low: float = 0.5,
                   high: float = 2.0, threshold: str | float | None = None) -> torch.Tensor:
    """Keep mask [B, T] (bool): masked-in tokens that pass every criterion of `rejection`
    (see tandem.algorithms.rejection), e.g. "token": ratio pi_old / pi_rollout in [low, high]."""
    criteria = parse_rejection(rejection, low, high, threshold)
    log_ratio = _log_ratios(old_log_probs, rollout_log_probs, response_mask, "token")
    return rejection_keep(log_ratio, response_mask, criteria)[0]


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """Apply algorithm.rollout_correction to one batch of [B, T] tensors.

    The caller multiplies the per-token loss by `weights` and aggregates with `loss_mask`.
    Weights (and their batch normalisation) are computed over response_mask, as in verl.
    Metrics are over masked-in tokens and non-empty sequences of response_mask.
    """
    mask = response_mask.bool()
    keep = mask
    weights = None
    metrics: dict[str, float] = {}
    criteria = parse_rejection(config.rejection, config.rejection_low, config.rejection_high,
                               config.rejection_threshold)
    if criteria:
        log_ratio = _log_ratios(old_log_probs, rollout_log_probs, mask, "token")
        keep, metrics = rejection_keep(log_ratio, mask, criteria)
        sequences = mask.any(dim=-1)
        metrics["rollout_correction/rejected_token_fraction"] = float(
            masked_mean((mask & ~keep).float(), mask))
        metrics["rollout_correction/rejected_sequence_fraction"] = float(
            masked_mean((sequences & ~keep.any(dim=-1)).float(), sequences))
    level = config.importance_sampling
    if level != "none":
        upper = config.importance_sampling_threshold
        log_ratio = _log_ratios(old_log_probs, rollout_log_probs, mask, level)
        if config.importance_sampling_mode == "icepop":
            low = config.importance_sampling_low
            weights = icepop_importance_weights(old_log_probs, rollout_log_probs, mask, level, low, upper)
            outside = (log_ratio < math.log(low)) | (log_ratio > math.log(upper))
            metrics["rollout_correction/zeroed_fraction"] = float(masked_mean(outside.float(), keep))
        else:
            weights = truncated_importance_weights(old_log_probs, rollout_log_probs, mask, level, upper)
            truncated = log_ratio > math.log(upper)
            metrics["rollout_correction/truncated_fraction"] = float(masked_mean(truncated.float(), keep))
        if config.importance_sampling_batch_normalize:
            weights, factor = batch_normalize_weights(weights, mask, level)
            metrics["rollout_correction/batch_norm_factor"] = factor
        metrics["rollout_correction/weight_mean"] = float(masked_mean(weights, keep))
    return RolloutCorrection(weights=weights, loss_mask=keep, metrics=metrics)


def bypass_old_log_probs(rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Bypass mode: old_log_probs [B, T] = rollout_log_probs (detached copy, 0 where masked).

    The actor re-forward is skipped, so PPO's ratio is pi_theta / pi_rollout directly.
    """
    require_same_shape(rollout_log_probs=rollout_log_probs, response_mask=response_mask)
    return torch.where(response_mask.bool(), rollout_log_probs.detach(),
                       torch.zeros((), dtype=rollout_log_probs.dtype, device=rollout_log_probs.device))
