"""The rejection setting of rollout correction parsed into criteria (no torch: config
validation reads it before torch is imported). tandem.algorithms.rejection evaluates them."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
