"""Masked reductions over response-aligned tensors [B, T]; masked positions count exactly 0.

Masks are 0/1 (bool, int or float); any non-zero entry counts as 1. Reductions select with
`torch.where`, so a NaN or inf at a masked position never reaches the result or its gradient.
"""

from __future__ import annotations

import torch


def require_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the arguments when the given tensors do not share one shape."""
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; these must be response-aligned tensors of "
                         "the same shape [B, T]")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values where mask) over `dim` (all dims when None); [B, T] -> [B] or a scalar."""
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of non-zero mask entries over `dim` (all dims when None), as a float tensor."""
    counts = mask.bool().float()
    return counts.sum() if dim is None else counts.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask) over `dim`; 0 where the mask is empty (never NaN)."""
    count = masked_count(mask, dim).to(values.dtype)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked entries (scalar); 0 when fewer than two entries."""
    count = masked_count(mask).to(values.dtype)
    centered = values - masked_mean(values, mask)
    return masked_sum(centered * centered, mask) / (count - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  epsilon: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + epsilon) over masked entries of [B, T]; 0 at masked positions.

    With shift_mean=False the mean is added back (scale only).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest masked entry (scalar); 0 when the mask is empty."""
    if not bool(mask.bool().any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask.bool()].max()
