"""PPO clipped surrogate with asymmetric clip and dual clip, per token [B, T]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algorithms.masked import masked_mean, require_same_shape

# exp() of a log-ratio beyond this overflows float16 and carries no useful gradient anyway.
LOG_RATIO_LIMIT = 20.0


@dataclass
class PolicyLossOutput:
    """Per-token loss [B, T] (0 where masked) and detached scalar metrics over masked-in tokens."""

    loss: torch.Tensor
    clip_fraction_upper: torch.Tensor  # A > 0 and ratio > 1 + clip_ratio_high
    clip_fraction_lower: torch.Tensor  # A < 0 and ratio < 1 - clip_ratio_low
    clip_fraction_dual: torch.Tensor  # A < 0 and ratio > clip_ratio_c
    ppo_kl: torch.Tensor  # mean of old_log_probs - log_probs: a k1 estimate of KL(old || current)


def ppo_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, clip_ratio_low: float = 0.2,
                  clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                  importance_weights: torch.Tensor | None = None) -> PolicyLossOutput:
    """PPO loss per token, all [B, T]: r = exp(log_probs - old_log_probs),
    l = max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 also l = min(l, -A c).

    importance_weights [B, T] (detached, e.g. rollout-correction TIS weights) multiply l.
    """
    require_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                       response_mask=response_mask)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c is {clip_ratio_c}; the dual-clip constant must be > 1")
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0; got "
                         f"{clip_ratio_low}, {clip_ratio_high}")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    # Select before any arithmetic so values at masked positions cannot reach the gradient.
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    advantages = torch.where(mask, advantages.detach().to(log_probs.dtype), zero)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    if importance_weights is not None:
        require_same_shape(importance_weights=importance_weights, log_probs=log_probs)
        loss = loss * torch.where(mask, importance_weights.detach().to(loss.dtype), zero)
    loss = torch.where(mask, loss, zero)

    ratio, log_ratio, advantages = ratio.detach(), log_ratio.detach(), advantages.detach()
    return PolicyLossOutput(
        loss=loss,
        clip_fraction_upper=_fraction((advantages > 0) & (ratio > 1.0 + clip_ratio_high), mask),
        clip_fraction_lower=_fraction((advantages < 0) & (ratio < 1.0 - clip_ratio_low), mask),
        clip_fraction_dual=_fraction((advantages < 0) & (ratio > clip_ratio_c), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
    )


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.float(), mask)
