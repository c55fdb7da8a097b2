"""Advantage estimators: GRPO group-relative outcome advantage and GAE over masked tokens.

Both return detached tensors aligned with the response [B, T] and exactly 0 where the mask is 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from tandem.algorithms.masked import masked_sum, masked_whiten, require_same_shape

GroupIds = Sequence[Hashable] | torch.Tensor


def group_index(group_ids: GroupIds, batch_size: int) -> torch.Tensor:
    """Dense group numbers [B] in 0..G-1 from one id per trajectory (hashables or an int tensor [B])."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.ndim != 1 or group_ids.is_floating_point():
            raise ValueError(f"group_ids as a tensor must be 1-D integer [B]; got dtype "
                             f"{group_ids.dtype}, shape {tuple(group_ids.shape)}")
        _, index = torch.unique(group_ids, return_inverse=True)
    else:
        numbers: dict[Hashable, int] = {}
        index = torch.tensor([numbers.setdefault(uid, len(numbers)) for uid in group_ids],
                             dtype=torch.long)
    if index.shape[0] != batch_size:
        raise ValueError(f"group_ids has {index.shape[0]} entries but there are {batch_size} "
                         "trajectories; pass one prompt uid per trajectory")
    return index


def group_normalize(scores: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True,
                    epsilon: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-trajectory GRPO advantage [B]: (score - group mean) / (group std + epsilon).

    std is the unbiased (Bessel) std of the group, taken as 0 for a group of one; with
    norm_by_std=False only the mean is subtracted. Entries where `valid` [B] is False (padding
    samples) are left out of every group's statistics and get 0.
    """
    if scores.ndim != 1:
        raise ValueError(f"scores must be [B]; got shape {tuple(scores.shape)}")
    output_dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    scores = scores.detach().double()
    index = group_index(group_ids, scores.shape[0]).to(scores.device)
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    num_groups = int(index.max()) + 1 if index.numel() else 0
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    empty = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    # Centre on a member's score first, so a group of identical scores gives exactly 0.
    reference = empty.scatter_reduce(0, index, torch.where(valid, scores, -torch.inf), "amax",
                                     include_self=False)
    offsets = torch.where(valid, scores - reference[index], zero)
    count = empty.index_add(0, index, valid.to(scores.dtype))
    centered = offsets - (empty.index_add(0, index, offsets) / count.clamp(min=1))[index]
    centered = torch.where(valid, centered, zero)
    if norm_by_std:
        std = torch.sqrt(empty.index_add(0, index, centered * centered) / (count - 1).clamp(min=1))
        centered = centered / (std[index] + epsilon)
    return centered.to(output_dtype)


def grpo_outcome_advantage(scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds,
                           norm_adv_by_std_in_grpo: bool = True,
                           epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO advantage [B, T]: group_normalize(score)[b] on every masked-in token of row b, else 0.

    scores is [B] (one outcome per trajectory) or [B, T] token-level rewards, summed over the
    mask. Trajectories with an all-zero mask (padding samples) stay out of the group statistics.
    """
    mask = response_mask.bool()
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, T]; got shape {tuple(mask.shape)}")
    if scores.ndim == 2:
        require_same_shape(scores=scores, response_mask=response_mask)
        scores = masked_sum(scores, mask, dim=-1)
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores has shape {tuple(scores.shape)} but response_mask has "
                         f"{mask.shape[0]} rows; pass scores as [B] or [B, T]")
    advantage = group_normalize(scores, group_ids, norm_adv_by_std_in_grpo, epsilon,
                                valid=mask.any(dim=-1))
    return torch.where(mask, advantage[:, None], torch.zeros((), dtype=advantage.dtype,
                                                             device=advantage.device))


@torch.no_grad()
def gae_advantage(token_level_rewards: torch.Tensor, values: torch.Tensor,
                  response_mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
                  whiten_advantages: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the masked-in tokens of [B, T]; returns (advantages [B, T], returns [B, T]).

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is
    the next token with mask 1 (a masked token, e.g. a tool observation, is skipped: its reward
    and value are ignored and it is not a time step). After the last masked-in token V = 0.
    returns = A + V before whitening; whitening uses the masked mean and variance.
    """
    require_same_shape(token_level_rewards=token_level_rewards, values=values,
                       response_mask=response_mask)
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(mask, token_level_rewards.to(values.dtype), zero)
    values = torch.where(mask, values, zero)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        here = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, zero)
        next_advantage = torch.where(here, advantage, next_advantage)
        next_value = torch.where(here, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, zero)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns
