"""Split a mini-batch into micro-batches that each fit a token budget."""

from __future__ import annotations

import torch

from tandem.batch.layouts import group_members


def split_by_token_budget(lengths: torch.Tensor, max_tokens: int,
                          prompt_groups: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Group sample indices so each group's total length <= max_tokens, in few groups: first-fit
    over samples sorted longest first, indices ascending inside a group. With `prompt_groups` [B]
    the samples of a prompt are one unit, kept in one micro-batch where they fit, each sample still
    costing its whole length (docs/training.md, "Shared prompts"). lengths [B] -> list of LongTensor
    index groups."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.numel() == 0:
        return []
    longest = int(lengths.max())
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds the micro-batch token budget "
                         f"{max_tokens}; raise actor.ppo_max_token_len_per_micro_batch (and actor.micro_batch_memory_gb "
                         "when set) to hold rollout.prompt_length + rollout.response_length tokens")
    units, costs = _units(lengths.tolist(), max_tokens, prompt_groups)
    bins: list[list[int]] = []
    totals: list[int] = []
    for unit in sorted(range(len(units)), key=lambda u: -costs[u]):  # stable: ties keep their order
        for b, total in enumerate(totals):
            if total + costs[unit] <= max_tokens:
                bins[b].extend(units[unit])
                totals[b] += costs[unit]
                break
        else:
            bins.append(list(units[unit]))
            totals.append(costs[unit])
    return [torch.tensor(sorted(group), dtype=torch.long) for group in bins]


def _units(lengths: list[int], max_tokens: int, prompt_groups: torch.Tensor | None
           ) -> tuple[list[list[int]], list[int]]:
    """Samples -> units packed together (a prompt group, in parts of at most max_tokens) and
    their token costs."""
    if prompt_groups is None:
        return [[i] for i in range(len(lengths))], lengths
    units, costs = [], []
    for group in group_members(prompt_groups.tolist()):
        unit, cost = [], 0
        for i in group:
            if unit and cost + lengths[i] > max_tokens:
                units.append(unit)
                costs.append(cost)
                unit, cost = [], 0
            unit.append(i)
            cost += lengths[i]
        units.append(unit)
        costs.append(cost)
    return units, costs


def split_into(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """Refine `groups` into exactly `count` groups (halving the largest) so that every
    data-parallel rank runs the same number of forward/backward passes."""
    groups = list(groups)
    if count < len(groups):
        raise ValueError(f"split_into: cannot merge {len(groups)} groups into {count}")
    if count > sum(g.numel() for g in groups):
        raise ValueError(f"split_into: {count} micro-batches need at least {count} samples on every "
                         "rank; pad the batch with batch.padding.pad_for_data_parallel (a multiple "
                         "of the data-parallel size and the mini-batch size)")
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: groups[i].numel())
        group = groups.pop(largest)
        half = group.numel() // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups
