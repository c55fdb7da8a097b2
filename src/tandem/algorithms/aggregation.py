"""Reduce a per-token loss [B, T] to the scalar that is backpropagated (actor.loss_agg_mode).

For gradient accumulation, pass the counts of the whole mini-batch (from `loss_normalizers` on
its full mask, summed over ranks under data parallelism): the sum of the micro-batch losses then
equals the loss of the mini-batch in one piece, for every mode.
"""

from __future__ import annotations

import torch

from tandem.algorithms.masked import masked_count, masked_sum, require_same_shape
from tandem.config.choices import LOSS_AGG_MODES

Count = int | float | torch.Tensor


def loss_normalizers(mask: torch.Tensor) -> tuple[int, int]:
    """(token count, sequence count) of a mask [B, T]; a sequence counts when it has a token."""
    mask = mask.bool()
    return int(mask.sum()), int(mask.any(dim=-1).sum())


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   global_token_count: Count | None = None, global_seq_count: Count | None = None,
                   horizon: int | None = None) -> torch.Tensor:
    """Scalar loss from a per-token loss [B, T] and a 0/1 mask [B, T]:

    token-mean               sum_bt m*l / N_tokens
    token-sum                sum_bt m*l
    seq-mean-token-sum       sum_b (sum_t m*l) / N_seqs
    seq-mean-token-mean      sum_b (sum_t m*l / len_b) / N_seqs
    seq-mean-token-sum-norm  sum_bt m*l / (horizon * N_seqs)   (Dr. GRPO as current verl
                             computes it: horizon is a constant, e.g. rollout.response_length)

    N_tokens / N_seqs default to this batch's counts (sequences with no masked-in token, i.e.
    padding samples, are not counted); pass the mini-batch totals when accumulating.
    """
    require_same_shape(loss=loss, mask=mask)
    if loss.ndim != 2:
        raise ValueError(f"loss must be [B, T]; got shape {tuple(loss.shape)}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}")
    if mode == "token-mean":
        count = masked_count(mask) if global_token_count is None else global_token_count
        return masked_sum(loss, mask) / _at_least_one(count, loss)
    if mode == "token-sum":
        return masked_sum(loss, mask)
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs horizon, a positive constant such as "
                             "rollout.response_length (the same for every micro-batch)")
        count = mask.bool().any(dim=-1).sum() if global_seq_count is None else global_seq_count
        return masked_sum(loss, mask) / horizon / _at_least_one(count, loss)
    per_sequence = masked_sum(loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / masked_count(mask, dim=-1).to(loss.dtype).clamp(min=1)
    count = mask.bool().any(dim=-1).sum() if global_seq_count is None else global_seq_count
    return per_sequence.sum() / _at_least_one(count, loss)


def _at_least_one(count: Count, like: torch.Tensor) -> torch.Tensor:
    # An empty batch has a zero numerator; dividing by 1 keeps the loss (and its gradient) at 0.
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
