"""Per-token KL estimators between the policy and the reference policy, and their two uses.

The estimators follow Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx):
with log r = log pi_ref(x) - log pi(x) for a token x sampled from pi,
    k1 = -log r              unbiased, high variance, can be negative
    k2 = 0.5 (log r)^2       biased, low variance, never negative
    k3 = (r - 1) - log r     unbiased, low variance, never negative
Uses: `compute_kl_loss` (`actor_rollout_ref.actor.use_kl_loss`, `kl_loss_type`, `kl_loss_coef`) and
`apply_kl_penalty_to_rewards` (`algorithm.use_kl_in_reward`, `kl_penalty`, `kl_ctrl.kl_coef`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentrl.algorithms._masked import as_bool_mask, masked_mean
from agentrl.algorithms.losses import aggregate_loss

__all__ = [
    "KL_TYPES",
    "KLPenaltyResult",
    "apply_kl_penalty_to_rewards",
    "compute_kl_loss",
    "compute_kl_penalty",
]

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Valid values of `actor_rollout_ref.actor.kl_loss_type` and `algorithm.kl_penalty` (aliases paired)."""

_K3_CLAMP = 10.0
"""k3 is clamped to at most 10 (as verl does) so one token far off the reference cannot dominate."""
_MAX_LOG_RATIO = 20.0


class KLPenaltyResult(NamedTuple):
    """token_rewards: (B, T) scores minus the KL penalty. kl_mean: scalar, the batch mean over rows
    of each row's token-mean KL (logged as `actor/reward_kl_penalty`)."""

    token_rewards: torch.Tensor
    kl_mean: torch.Tensor


def compute_kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || pi_ref): log_probs, ref_log_probs (B, T) float -> (B, T).

    With d = log pi - log pi_ref of the sampled token:
      kl, k1            d
      abs               |d|
      mse, k2           0.5 d^2
      low_var_kl, k3    exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [0, 10]
    k3 is computed as expm1(-d) + d: the naive form cancels catastrophically for small d and
    rounds to small negative numbers in float32; the lower clamp at 0 (k3 >= 0 exactly) removes
    what rounding is left. verl clamps to [-10, 10]; on true values the two agree.
    Unreduced: apply the response mask when aggregating (`compute_kl_loss`, `aggregate_loss`).
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"ref_log_probs has shape {tuple(ref_log_probs.shape)}, expected {tuple(log_probs.shape)}"
        )
    diff = log_probs - ref_log_probs
    if kl_type in ("kl", "k1"):
        return diff
    if kl_type == "abs":
        return diff.abs()
    if kl_type in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_type in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(-diff, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.expm1(log_ratio) - log_ratio
        return torch.clamp(k3, 0.0, _K3_CLAMP)
    raise ValueError(f"unknown KL type {kl_type!r}; allowed: {', '.join(KL_TYPES)}")


def compute_kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """The KL loss term of GRPO (Shao et al. 2024): aggregate_loss(kl(pi, pi_ref), mask, mode).

    log_probs, ref_log_probs: (B, T) float; response_mask: (B, T) bool. Returns a scalar with grad
    (logged as `actor/kl_loss`); the actor adds `kl_loss_coef` times it to the policy loss.
    """
    kl = compute_kl_penalty(log_probs, ref_log_probs, kl_type)
    return aggregate_loss(kl, response_mask, loss_agg_mode)


def apply_kl_penalty_to_rewards(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_type: str = "kl",
) -> KLPenaltyResult:
    """KL-shaped rewards (Ziegler et al. 2019, arXiv:1909.08593): r_t = score_t - beta * kl_t.

    token_scores, log_probs, ref_log_probs: (B, T) float; response_mask: (B, T) bool.
    beta is `kl_coef`; the penalty lands only on valid tokens (masked positions keep their score).
    """
    mask = as_bool_mask(response_mask, token_scores, "response_mask")
    kl = compute_kl_penalty(log_probs, ref_log_probs, kl_type)
    kl = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    token_rewards = token_scores - kl_coef * kl
    row_kl = masked_mean(kl, mask, dim=-1)
    kl_mean = masked_mean(row_kl, mask.any(-1))
    return KLPenaltyResult(token_rewards, kl_mean.detach())
