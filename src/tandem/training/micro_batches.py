"""Split a mini-batch into micro-batches that each fit a token budget."""

from __future__ import annotations

import torch


def split_by_token_budget(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Group sample indices so each group's total length <= max_tokens, in few groups.

    First-fit over samples sorted longest first; indices inside a group are ascending.
    lengths [B] -> list of LongTensor index groups.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.numel() == 0:
        return []
    longest = int(lengths.max())
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds the micro-batch token budget "
                         f"{max_tokens}; raise actor.ppo_max_token_len_per_micro_batch (and actor.micro_batch_memory_gb "
                         "when set) to hold rollout.prompt_length + rollout.response_length tokens")
    bins: list[list[int]] = []
    totals: list[int] = []
    for index in torch.argsort(lengths, descending=True, stable=True).tolist():
        size = int(lengths[index])
        for b, total in enumerate(totals):
            if total + size <= max_tokens:
                bins[b].append(index)
                totals[b] += size
                break
        else:
            bins.append([index])
            totals.append(size)
    return [torch.tensor(sorted(group), dtype=torch.long) for group in bins]


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
