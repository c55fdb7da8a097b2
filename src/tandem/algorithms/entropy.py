"""Policy entropy per token and the entropy bonus term of the actor loss."""

from __future__ import annotations

import torch

from tandem.algorithms.aggregation import Count, aggregate_loss


def entropy_from_logits(logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Entropy [B, T] of softmax(logits [B, T, V]): logsumexp(z) - sum_v softmax(z)_v z_v.
    masked: logits may hold -inf (tokens outside a kept set), which have probability 0."""
    probabilities = torch.softmax(logits, dim=-1)
    finite = logits.masked_fill(logits.isneginf(), 0.0) if masked else logits  # 0 * -inf is nan
    return torch.logsumexp(logits, dim=-1) - (probabilities * finite).sum(dim=-1)


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, entropy_coeff: float,
                  loss_agg_mode: str = "token-mean", global_token_count: Count | None = None,
                  global_seq_count: Count | None = None,
                  horizon: int | None = None) -> torch.Tensor:
    """Scalar term to add to the actor loss: -entropy_coeff * aggregate_loss(entropy [B, T], mask)."""
    return -entropy_coeff * aggregate_loss(entropy, response_mask, loss_agg_mode,
                                           global_token_count, global_seq_count, horizon)
