"""Sequence balancing (seed §8.3 "balance"): order a padded batch so that its contiguous
data-parallel shards carry equal token counts and equal shares of real samples.

A rank's shard is its contiguous 1/world_size of the batch (`training.fsdp.shard_batch`), and
each rank trains on its shard's k-th local chunk at optimizer step k, so global mini-batch k is
the union of the ranks' k-th chunks. `balance_order` keeps mini-batch k's real samples the k-th
contiguous run of the batch's real samples (prompt groups stay together, as generated), spreads
the padding samples evenly over the mini-batches, and splits each mini-batch over the ranks by a
largest-first partition of token counts with real-sample counts differing by at most one,
heaviest part to the rank with the fewest tokens so far. Given prompt groups (GRPO's n samples
of a prompt), whole groups go to ranks where the counts allow it (every group of the
mini-batch the same size, dividing every rank's share), so a shared-prompt forward computes
each prompt once per step instead of once per rank it landed on. So every rank gets real samples when
there are at least as many as ranks (none trains on padding only), and no rank waits long for
another at each optimizer step's gradient all-reduce. GRPO advantages need no grouping here: they are computed on the
driver over the whole batch.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch
from tensordict import TensorDict

from tandem.batch.jagged import field_lengths, select_samples
from tandem.batch.layouts import group_members, prompt_groups


def balanced_partition(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Indices of `lengths` split into len(sizes) parts of exactly those sizes, token sums as
    equal as possible: longest first, each to the lightest part that still has room
    (largest-first greedy under a size constraint). Indices ascend per part."""
    if sum(sizes) != len(lengths):
        raise ValueError(f"balanced_partition: part sizes {list(sizes)} do not add up to "
                         f"{len(lengths)} samples")
    parts: list[list[int]] = [[] for _ in sizes]
    heap = [(0, part) for part, size in enumerate(sizes) if size > 0]
    heapq.heapify(heap)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, part = heapq.heappop(heap)
        parts[part].append(index)
        if len(parts[part]) < sizes[part]:
            heapq.heappush(heap, (total + lengths[index], part))
    return [sorted(part) for part in parts]


def _even_split(count: int, parts: int) -> list[int]:
    """count split into `parts` sizes differing by at most one, larger ones first."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def _partition(chunk: list[int], lengths: Sequence[int], sizes: list[int],
               groups: Sequence[int] | None) -> list[list[int]]:
    """chunk's samples split into parts of `sizes` samples, token sums balanced; whole prompt
    groups per part when every group has one size that divides every part's size."""
    units = group_members(groups, chunk) if groups is not None else []
    size = len(units[0]) if units else 1
    if size == 1 or any(len(u) != size for u in units) or any(s % size for s in sizes):
        return [[chunk[i] for i in part] for part in
                balanced_partition([lengths[i] for i in chunk], sizes)]
    parts = balanced_partition([sum(lengths[i] for i in unit) for unit in units], [s // size for s in sizes])
    return [sorted(i for u in part for i in units[u]) for part in parts]


def balance_order(lengths: Sequence[int], is_padding: Sequence[bool], world_size: int,
                  mini_batch_size: int, groups: Sequence[int] | None = None) -> list[int]:
    """The sample order whose contiguous shards (world_size of them) are balanced per global
    mini-batch of `mini_batch_size` samples (see the module docstring). The batch size must be a
    multiple of mini_batch_size, and mini_batch_size of world_size. `groups` [B]: samples with
    the same id share a prompt (layouts.prompt_groups) and stay on one rank where they can."""
    size = len(lengths)
    if mini_batch_size % world_size or size % mini_batch_size:
        raise ValueError(f"balance_order: {size} samples in mini-batches of {mini_batch_size} over "
                         f"{world_size} ranks do not divide; pad with batch.padding.pad_for_data_parallel")
    real = [i for i in range(size) if not is_padding[i]]
    padding = [i for i in range(size) if is_padding[i]]
    per_rank = mini_batch_size // world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for count in _even_split(len(real), size // mini_batch_size):
        chunk, real = real[:count], real[count:]
        parts = _partition(chunk, lengths, _even_split(count, world_size), groups)
        parts.sort(key=lambda part: (-len(part), -sum(lengths[i] for i in part)))
        # the heaviest part to the rank with the fewest tokens so far: the step balances too,
        # and a mini-batch with fewer real samples than ranks hands them to different ranks
        for part, rank in zip(parts, sorted(range(world_size), key=lambda r: (totals[r], r))):
            fill = per_rank - len(part)
            shards[rank] += part + padding[:fill]
            padding = padding[fill:]
            totals[rank] += sum(lengths[i] for i in part)
    return [index for shard in shards for index in shard]


def balance_batch(batch: TensorDict, world_size: int, mini_batch_size: int,
                  keep_prompt_groups: bool = False) -> TensorDict:
    """The batch reordered by `balance_order` on its sequence lengths (prompt + response);
    `keep_prompt_groups`: samples sharing a prompt stay on one rank where the counts allow."""
    groups = prompt_groups(batch).tolist() if keep_prompt_groups else None
    order = balance_order(field_lengths(batch["input_ids"]).tolist(), batch["is_padding"].tolist(),
                          world_size, mini_batch_size, groups)
    return select_samples(batch, torch.tensor(order, dtype=torch.long))


def token_imbalance(batch: TensorDict, world_size: int, mini_batch_size: int) -> dict[str, float]:
    """max / mean of the ranks' token counts (1.0 = balanced) over the step and, the worst, over
    one mini-batch (the ranks meet at every optimizer step's all-reduce)."""
    lengths = field_lengths(batch["input_ids"]).double()
    per_rank = mini_batch_size // world_size
    # [rank, mini-batch, sample]: the layout shard_batch and the engine's update give
    tokens = lengths.view(world_size, -1, per_rank).sum(-1)

    def ratio(totals: torch.Tensor) -> torch.Tensor:
        return totals.max(0).values / totals.mean(0)

    return {"balance/token_imbalance": float(ratio(tokens.sum(1, keepdim=True))),
            "balance/token_imbalance_worst_mini_batch": float(ratio(tokens).max())}
