"""Sampling-mask replay: log-probabilities and entropy renormalised over the set of token ids the
rollout engine sampled each token from (top-k / top-p survivors; docs/algorithms.md)."""

from __future__ import annotations

import torch


def restrict_to_kept(logits: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> a copy at -inf outside each row's kept set; rows with count 0 unchanged.
    counts [N] and ids [sum counts] (each row's ids back to back), on the logits' device."""
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=logits.device), counts.long())
    outside = counts.gt(0)[:, None].expand_as(logits).clone()
    outside[rows, ids.long()] = False
    return logits.masked_fill(outside, float("-inf"))


def chunk_of_kept(counts: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, start: int,
                  stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, stop) of kept sets given as counts [N], ids, and offsets [N+1] into ids."""
    return counts[start:stop], ids[int(offsets[start]):int(offsets[min(stop, counts.numel())])]


def kept_mass(logits: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Probability mass [N] of each row's kept set under softmax(logits [N, V]); 1 for count 0."""
    kept = restrict_to_kept(logits, counts, ids)
    return torch.exp(torch.logsumexp(kept, dim=-1) - torch.logsumexp(logits, dim=-1))
