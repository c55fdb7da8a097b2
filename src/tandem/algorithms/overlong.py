"""Answers cut at the length limit (DAPO, arXiv 2503.14476 §3.4): a soft penalty over the last
`buffer_len` tokens before the limit, and the mask that takes truncated answers out of the loss."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """[B] reward added per answer of `lengths` [B] tokens: 0 up to max_length - buffer_len, then
    falling linearly to -factor at max_length, -factor beyond it (DAPO's soft punishment)."""
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = max_length - buffer_len
    over = (lengths.float() - start).clamp(min=0.0, max=float(buffer_len))
    return -factor * over / buffer_len


def keep_untruncated(truncated: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, T] with every row of a truncated answer (`truncated` [B] bool) set to 0."""
    return loss_mask * (~truncated).to(loss_mask.dtype)[:, None]
