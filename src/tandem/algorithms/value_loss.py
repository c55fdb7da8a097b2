"""Critic loss with value clipping (critic.cliprange_value), per token [B, T]."""

from __future__ import annotations

import torch

from tandem.algorithms.masked import masked_mean, require_same_shape


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       response_mask: torch.Tensor,
                       cliprange_value: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [B, T], clip fraction scalar): 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

    The clip fraction counts masked-in tokens where the clipped term is the larger one; the
    loss is 0 at masked positions. Reduce it with aggregate_loss.
    """
    require_same_shape(values=values, old_values=old_values, returns=returns,
                       response_mask=response_mask)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value is {cliprange_value}; it must be >= 0")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(mask, values, zero)
    old_values = torch.where(mask, old_values.detach().to(values.dtype), zero)
    returns = torch.where(mask, returns.detach().to(values.dtype), zero)
    clipped_values = values.clamp(old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = torch.where(mask, 0.5 * torch.maximum(unclipped_loss, clipped_loss), zero)
    clip_fraction = masked_mean((clipped_loss > unclipped_loss).detach().to(values.dtype), mask)
    return loss, clip_fraction
