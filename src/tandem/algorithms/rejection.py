"""Rejection criteria of rollout correction: which tokens or whole sequences leave the loss.

A criterion compares a statistic of the token log-ratio d = old_log_probs - rollout_log_probs
(log pi_old / pi_rollout, clamped to +-20) with bounds. Several criteria combine with AND.

  token, sequence      d, or sum_t d over the sequence, in [log rejection_low, log rejection_high]
  verl's <agg>_<k>     per-token k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d, taken per token
                       (token_) or per sequence as sum, mean or max (seq_sum_, seq_mean_, seq_max_);
                       k1 is kept in [log lower, log upper], k2 and k3 below upper.
"""

from __future__ import annotations

import math

import torch

from tandem.algorithms.masked import masked_mean, masked_sum
from tandem.config.rejection_spec import (LOG_RATIO_LIMIT, REJECTION_CRITERIA, TANDEM_CRITERIA,
                                         VERL_CRITERIA, RejectionCriterion, parse_rejection)

__all__ = ["LOG_RATIO_LIMIT", "REJECTION_CRITERIA", "TANDEM_CRITERIA", "VERL_CRITERIA",
           "RejectionCriterion", "parse_rejection", "criterion_statistic", "rejection_keep"]


def criterion_statistic(log_ratio: torch.Tensor, mask: torch.Tensor,
                        criterion: RejectionCriterion) -> torch.Tensor:
    """The criterion's statistic [B, T]: per token, or its sequence's value on every token."""
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if criterion.statistic == "log_ratio":
        per_token = log_ratio
    elif criterion.statistic == "k1":
        per_token = -log_ratio
    elif criterion.statistic == "k2":
        per_token = 0.5 * log_ratio * log_ratio
    else:
        per_token = torch.exp(log_ratio) - 1 - log_ratio
    if criterion.aggregation == "token":
        return per_token
    if criterion.aggregation == "seq_sum":
        per_sequence = masked_sum(per_token, mask, dim=-1)
    elif criterion.aggregation == "seq_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
    else:
        lowest = torch.full((), -math.inf, dtype=per_token.dtype, device=per_token.device)
        per_sequence = torch.where(mask.bool(), per_token, lowest).amax(dim=-1)
    return per_sequence[:, None].expand_as(per_token)


def rejection_keep(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                   criteria: list[RejectionCriterion]) -> tuple[torch.Tensor, dict[str, float]]:
    """(keep [B, T] bool: masked-in tokens that pass every criterion, per-criterion metrics).

    Metrics per criterion: the fraction of masked-in tokens it rejects and the mean of its
    statistic over masked-in tokens (token level) or non-empty sequences (sequence level).
    """
    mask = response_mask.bool()
    keep = mask
    metrics: dict[str, float] = {}
    sequences = mask.any(dim=-1)
    for criterion in criteria:
        statistic = criterion_statistic(log_ratio, mask, criterion)
        inside = statistic <= criterion.upper
        if criterion.lower is not None:
            inside = inside & (statistic >= criterion.lower)
        keep = keep & inside
        prefix = f"rollout_correction/{criterion.name}"
        metrics[f"{prefix}/rejected_token_fraction"] = float(masked_mean((~inside).float(), mask))
        if criterion.aggregation == "token":
            metrics[f"{prefix}/mean"] = float(masked_mean(statistic, mask))
        else:  # a sequence's value sits on each of its tokens: read it from the first column
            metrics[f"{prefix}/mean"] = float(masked_mean(statistic[:, :1], sequences[:, None]))
    return keep, metrics
