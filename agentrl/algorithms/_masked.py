"""Masked reductions and per-group statistics shared by the estimators, losses and filters.

Masked positions never leak into a result: every reduction selects with `torch.where` rather than
multiplying by the mask, so a NaN or inf sitting under `mask=False` (padding logits, stale values)
cannot turn a sum into NaN.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8
"""Added to the variance before the square root in `masked_whiten` (verl's constant)."""


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """Check `mask` has the shape of `like` and return it as bool (0/1 ints or floats are accepted)."""
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where the bool `mask` is True; over all elements when `dim` is None."""
    selected = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where the bool `mask` is True.

    values: (...) float, mask: (...) bool of the same shape. With `dim=None` the result is a scalar;
    otherwise `dim` is reduced. A slice with no valid position gives 0 (not NaN), so an empty
    micro-batch contributes nothing instead of poisoning the step.
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance over all valid positions; 0 when fewer than two."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    sq = masked_sum((values - mean) ** 2, mask)
    return sq / (count - 1).clamp(min=1).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """Shift to zero mean and scale to unit variance over the valid positions of the whole tensor.

    values: (B, T) float; mask: (B, T) bool. Returns (B, T) with masked positions set to 0:
    `(x - mean) / sqrt(var + eps)`, mean and unbiased variance taken over valid tokens only
    (the advantage normalisation of PPO implementations, e.g. verl's `masked_whiten`).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, whitened, torch.zeros((), dtype=values.dtype, device=values.device))


def index_groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (B,) to dense indices 0..G-1; returns (inverse (B,) long, G)."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (B,), got shape {tuple(group_ids.shape)}")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(unique.numel())


def group_mean_std(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int):
    """Per-sample group statistics of `scores` (B,): (count, mean, unbiased std), each (B,).

    The std of a group of one is reported as 0.
    """
    dtype = scores.dtype
    count = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    total = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, inverse, scores)
    mean = total / count
    sq = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(
        0, inverse, (scores - mean[inverse]) ** 2
    )
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[inverse], mean[inverse], std[inverse]
