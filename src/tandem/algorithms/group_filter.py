"""Dynamic sampling (DAPO, arXiv 2503.14476 §3.2): a GRPO group whose samples all score the same
has zero advantage and trains nothing, so it is dropped and more prompts are drawn."""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence


def groups_with_signal(values: Sequence[float], group_ids: Sequence[Hashable]) -> set[Hashable]:
    """The ids of the groups whose `values` (one per sample, [B], with `group_ids` [B]) are not
    all equal: non-zero variance. A group of one sample has no variance and is left out."""
    if len(values) != len(group_ids):
        raise ValueError(f"{len(values)} values for {len(group_ids)} group ids: give one per sample")
    seen: dict[Hashable, set[float]] = defaultdict(set)
    for value, group_id in zip(values, group_ids):
        seen[group_id].add(float(value))
    return {group_id for group_id, distinct in seen.items() if len(distinct) > 1}
