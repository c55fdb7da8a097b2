"""KL penalties between two log-prob tensors [B, T], used as KL-in-reward and as KL loss.

All estimate KL(pi || pi_ref) from tokens sampled by pi, with x = log_probs - ref_log_probs:
k1 (kl) = x, abs = |x|, k2 (mse) = x^2 / 2, k3 (low_var_kl) = exp(-x) + x - 1. A trailing "+"
(k1+, abs+, k3+, ...) keeps the estimator's value but backpropagates k2's gradient
(straight-through: k2 + stop_grad(estimator - k2)).
"""

from __future__ import annotations

import torch

from tandem.algorithms.aggregation import Count, aggregate_loss
from tandem.algorithms.masked import masked_mean, require_same_shape
from tandem.config.choices import KL_ALIASES, KL_TYPES

# k3 is clamped to [-K3_LIMIT, K3_LIMIT] (and its log-ratio to +-20 before exp) for stability.
K3_LIMIT = 10.0
LOG_RATIO_LIMIT = 20.0


def resolve_kl_type(kl_type: str) -> tuple[str, bool]:
    """(estimator in k1 | abs | k2 | k3, straight_through) for a kl type or its verl alias."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl type {kl_type!r}; valid types are {', '.join(KL_TYPES)}")
    name = kl_type.removesuffix("+")
    return KL_ALIASES.get(name, name), kl_type.endswith("+")


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str,
               response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate [B, T] of kind kl_type (see KL_TYPES; "+" = straight-through k2 gradient).

    ref_log_probs is detached. With response_mask, masked positions are 0 in value and gradient.
    """
    require_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    estimator, straight_through = resolve_kl_type(kl_type)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    difference = log_probs - ref_log_probs.detach().to(log_probs.dtype)
    if response_mask is not None:
        require_same_shape(log_probs=log_probs, response_mask=response_mask)
        difference = torch.where(response_mask.bool(), difference, zero)
    k2 = 0.5 * difference * difference
    if estimator == "k1":
        value = difference
    elif estimator == "abs":
        value = difference.abs()
    elif estimator == "k2":
        value = k2
    else:
        log_ratio = (-difference).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        value = (torch.exp(log_ratio) - log_ratio - 1).clamp(-K3_LIMIT, K3_LIMIT)
    if straight_through:
        return k2 + (value - k2).detach()
    return value


def kl_loss(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor,
            kl_type: str = "low_var_kl", loss_agg_mode: str = "token-mean",
            global_token_count: Count | None = None, global_seq_count: Count | None = None,
            horizon: int | None = None) -> torch.Tensor:
    """Scalar KL loss: aggregate_loss(kl_penalty(log_probs [B, T], ref_log_probs [B, T]), mask)."""
    kl = kl_penalty(log_probs, ref_log_probs, kl_type, response_mask)
    return aggregate_loss(kl, response_mask, loss_agg_mode, global_token_count, global_seq_count,
                          horizon)


@torch.no_grad()
def kl_in_reward(token_level_scores: torch.Tensor, log_probs: torch.Tensor,
                 ref_log_probs: torch.Tensor, response_mask: torch.Tensor, kl_coef: float,
                 kl_type: str = "k1") -> tuple[torch.Tensor, float]:
    """(token_level_rewards [B, T], current_kl): rewards = scores - kl_coef * kl per masked-in token.

    log_probs are the actor's old_log_probs. current_kl, the input of an adaptive KL controller,
    is the mean over non-empty sequences of each sequence's masked mean KL.
    """
    require_same_shape(token_level_scores=token_level_scores, log_probs=log_probs,
                       response_mask=response_mask)
    mask = response_mask.bool()
    kl = kl_penalty(log_probs, ref_log_probs, kl_type, mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(mask, token_level_scores.to(kl.dtype) - kl_coef * kl, zero)
    per_sequence = masked_mean(kl, mask, dim=-1)
    current_kl = masked_mean(per_sequence, mask.any(dim=-1))
    return rewards, float(current_kl)
