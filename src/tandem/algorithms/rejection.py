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
from dataclasses import dataclass

import torch

from tandem.algorithms.masked import masked_mean, masked_sum

LOG_RATIO_LIMIT = 20.0
TANDEM_CRITERIA = ("token", "sequence")
VERL_CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                 "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
REJECTION_CRITERIA = TANDEM_CRITERIA + VERL_CRITERIA


@dataclass(frozen=True)
class RejectionCriterion:
    """Keep where lower <= aggregation(statistic) <= upper; a None lower bound is not checked."""

    name: str  # as configured, e.g. "token" or "seq_mean_k3"
    statistic: str  # k1 | k2 | k3 | log_ratio
    aggregation: str  # token | seq_sum | seq_mean | seq_max
    lower: float | None
    upper: float


def parse_rejection(spec: str, low: float = 0.5, high: float = 2.0,
                    threshold: str | float | None = None) -> list[RejectionCriterion]:
    """Criteria from `rejection` ("none" or comma-separated names; duplicates dropped).

    token / sequence use the ratio bounds [low, high]. verl's names take `threshold`, verl's
    rollout_rs_threshold: one entry for all of them or one per name, comma-separated; a k1 entry
    is "lower_upper" (a single number u means 1/u_u), a k2/k3 entry is one upper bound.
    """
    names = list(dict.fromkeys(name.strip() for name in spec.split(",") if name.strip()))
    if names == ["none"]:
        return []
    valid = f"valid values are none or comma-separated criteria from {', '.join(REJECTION_CRITERIA)}"
    if not names or "none" in names:
        raise ValueError(f"{spec!r} is not a rejection setting; {valid}")
    for name in names:
        if name not in REJECTION_CRITERIA:
            raise ValueError(f"unknown rejection criterion {name!r}; {valid}")
    verl_names = [name for name in names if name in VERL_CRITERIA]
    entries = _threshold_entries(verl_names, threshold)
    criteria = []
    for name in names:
        if name in TANDEM_CRITERIA:
            if not 0 < low <= high:
                raise ValueError(f"{name} needs bounds with 0 < rejection_low <= rejection_high; "
                                 f"got {low}, {high}")
            aggregation = "token" if name == "token" else "seq_sum"
            criteria.append(RejectionCriterion(name, "log_ratio", aggregation, math.log(low),
                                               math.log(high)))
        else:
            criteria.append(_verl_criterion(name, entries[verl_names.index(name)]))
    return criteria


def _threshold_entries(verl_names: list[str], threshold: str | float | None) -> list[str]:
    if not verl_names:
        if threshold is not None:
            raise ValueError(f"rejection_threshold={threshold!r} would be ignored: only verl's criteria "
                             f"({', '.join(VERL_CRITERIA)}) read it; token and sequence use "
                             "rejection_low / rejection_high. Unset it or add a verl criterion")
        return []
    if threshold is None:
        raise ValueError(f"rejection_threshold (verl's rollout_rs_threshold) must be set for "
                         f"{', '.join(verl_names)}, e.g. '0.5_2.0' for a k1 criterion or '0.01' for k2/k3")
    entries = [entry.strip() for entry in str(threshold).split(",") if entry.strip()]
    if len(entries) == 1:
        return entries * len(verl_names)
    if len(entries) != len(verl_names):
        raise ValueError(f"rejection_threshold has {len(entries)} entries for the {len(verl_names)} "
                         f"criteria {', '.join(verl_names)}; give one for all or one per criterion")
    return entries


def _verl_criterion(name: str, entry: str) -> RejectionCriterion:
    aggregation, statistic = name.rsplit("_", 1)
    try:
        bounds = [float(part) for part in entry.split("_")]
    except ValueError:
        raise ValueError(f"rejection_threshold entry {entry!r} of {name} is not a number") from None
    if statistic == "k1":
        if len(bounds) == 1:
            bounds = [1.0 / bounds[0], bounds[0]] if bounds[0] > 0 else bounds * 2
        if len(bounds) != 2 or not 0 < bounds[0] <= bounds[1]:
            raise ValueError(f"rejection_threshold entry {entry!r} of {name} must be 'lower_upper' "
                             "with 0 < lower <= upper (or one upper bound u, meaning 1/u_u)")
        return RejectionCriterion(name, statistic, aggregation, math.log(bounds[0]), math.log(bounds[1]))
    if len(bounds) != 1 or bounds[0] <= 0:
        raise ValueError(f"rejection_threshold entry {entry!r} of {name} must be one positive upper "
                         "bound (k2 and k3 are never negative, so they have no lower bound)")
    return RejectionCriterion(name, statistic, aggregation, None, bounds[0])


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
