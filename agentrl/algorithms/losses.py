"""PPO policy and value losses, loss aggregation, and the per-token quantities they need.

Shapes: B sequences by T response positions; V vocabulary size. Every mask is (B, T) bool and
True on tokens the loss trains on. Statistics in the result tuples are detached scalars, ready to
log (`actor/pg_clipfrac`, `actor/ppo_kl`, ...); only `loss` carries gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentrl.algorithms._masked import as_bool_mask, masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "PolicyLossResult",
    "ValueLossResult",
    "aggregate_loss",
    "compute_entropy_from_logits",
    "compute_policy_loss",
    "compute_token_log_probs",
    "compute_value_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Valid values of `actor_rollout_ref.actor.loss_agg_mode` and `critic.loss_agg_mode`."""

_MAX_LOG_RATIO = 20.0
"""log(pi/pi_old) is clamped to +-20 before exp so a stale or padded token cannot overflow to inf."""


class PolicyLossResult(NamedTuple):
    """loss: scalar with grad. clipfrac: share of valid tokens where the PPO clip is active.
    clipfrac_lower: share where the dual clip (A < 0) is active. ppo_kl: mean of log(pi_old / pi)
    (k1 estimate of KL(pi_old || pi)). ratio_mean: mean of pi / pi_old. All over valid tokens."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    ratio_mean: torch.Tensor


class ValueLossResult(NamedTuple):
    """loss: scalar with grad; clipfrac: share of valid tokens where the clipped error was larger."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *, norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) over the bool mask (B, T) to a scalar, as `loss_agg_mode` says.

    With l the loss, m the mask, L_i = sum_t m_{i,t} the valid length of row i and B' the number
    of rows with L_i > 0:
      token-mean               sum_{i,t} m l / sum_{i,t} m       (every token weighs the same; DAPO)
      seq-mean-token-sum       (1/B') sum_i sum_t m l             (sum per sequence, mean over rows)
      seq-mean-token-mean      (1/B') sum_i (sum_t m l) / L_i     (original GRPO)
      seq-mean-token-sum-norm  (1/B') sum_i (sum_t m l) / norm_length   (Dr. GRPO, arXiv:2503.20783)
    `norm_length` is the constant of the last mode; it defaults to T, the padded width of this
    tensor. Pass `data.max_response_length` when micro-batches are padded to different widths, so
    the constant really is constant. Rows with no valid token add nothing and are not counted.
    (verl's version of the last mode omits the 1/B'; ours is the paper's, so its scale does not
    grow with the micro-batch size.)
    """
    mask = as_bool_mask(mask, loss_mat, "mask")
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    row_has_tokens = mask.any(-1)
    row_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return masked_mean(row_sums, row_has_tokens)
    if mode == "seq-mean-token-mean":
        row_means = row_sums / mask.sum(-1).clamp(min=1).to(loss_mat.dtype)
        return masked_mean(row_means, row_has_tokens)
    if mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        return masked_mean(row_sums, row_has_tokens) / length
    raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    behaviour_weights: torch.Tensor | None = None,
) -> PolicyLossResult:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual clip.

    log_probs, old_log_probs, advantages: (B, T) float (log pi, log pi_old of the sampled tokens;
    A); response_mask: (B, T) bool. Per token, with rho = exp(log pi - log pi_old):
        l     = max(-A * rho, -A * clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))
        l     = min(l, -A * clip_ratio_c)        only where A < 0 (dual clip, Ye et al. 2020,
                                                  arXiv:1912.09729: caps the loss of a token whose
                                                  ratio has grown huge under a negative advantage)
    then `aggregate_loss(l, response_mask, loss_agg_mode)`. Setting clip_ratio_high above
    clip_ratio_low is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).

    behaviour_weights: optional (B, T) off-policy correction (decoupled PPO): each token's l is multiplied
    by its weight, detached, before aggregation; the clip still uses pi / pi_old. Built by
    `agentrl.algorithms.rollout_correction.behaviour_weights`; None leaves the loss as it was. The
    statistics (clipfrac, ppo_kl, ...) are not weighted.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1.0 (actor_rollout_ref.actor.clip_ratio_c), got {clip_ratio_c}"
        )
    mask = as_bool_mask(response_mask, log_probs, "response_mask")
    log_ratio = torch.clamp(log_probs - old_log_probs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_ppo, loss_dual_cap), loss_ppo)
    if behaviour_weights is not None:
        if behaviour_weights.shape != loss_mat.shape:
            raise ValueError(
                f"behaviour_weights has shape {tuple(behaviour_weights.shape)}, expected {tuple(loss_mat.shape)}"
            )
        loss_mat = loss_mat * behaviour_weights.detach().to(loss_mat.dtype)

    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, norm_length=norm_length)
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
        clipfrac_lower = masked_mean((negative & (loss_ppo > loss_dual_cap)).float(), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
        ratio_mean = masked_mean(ratio, mask)
    return PolicyLossResult(loss, clipfrac, clipfrac_lower, ppo_kl, ratio_mean)


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
) -> ValueLossResult:
    """Clipped value loss of PPO (Schulman et al. 2017; the form in OpenAI baselines' ppo2).

    values: (B, T) new critic predictions V; old_values: (B, T) predictions at rollout time V_old;
    returns: (B, T) targets R (from `compute_advantages`); response_mask: (B, T) bool.
        V_clip = V_old + clip(V - V_old, -cliprange_value, cliprange_value)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)
    aggregated with `loss_agg_mode` (`critic.loss_agg_mode`); `cliprange_value` is `critic.cliprange_value`.
    """
    mask = as_bool_mask(response_mask, values, "response_mask")
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(err_unclipped, err_clipped)
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, norm_length=norm_length)
    with torch.no_grad():
        clipfrac = masked_mean((err_clipped > err_unclipped).float(), mask)
    return ValueLossResult(loss, clipfrac)


def _row_chunks(flat: torch.Tensor, chunk_size: int):
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return flat.split(chunk_size, dim=0)


def compute_entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the softmax distribution at each position: logits (B, T, V) -> (B, T) float32.

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v z_v
    which avoids log(0) for tokens of zero probability. The logits are shifted by their maximum
    first (H does not change), so large logits lose no precision. Computed in float32, `chunk_size` rows of
    (B*T) at a time, so the float32 temporaries stay at chunk_size x V however long the batch.
    Differentiable (the entropy bonus `actor_rollout_ref.actor.entropy_coeff` backpropagates).
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in _row_chunks(flat, chunk_size):
        z = chunk.float()
        z = z - z.max(-1, keepdim=True).values.detach()  # H is shift-invariant; keeps precision at large z
        parts.append(torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
    return torch.cat(parts).reshape(lead) if parts else flat.new_zeros(lead, dtype=torch.float32)


def compute_token_log_probs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(logits)[token]: logits (B, T, V), token_ids (B, T) long -> (B, T) float32.

    Computed as z[token] - logsumexp(z) on `chunk_size` rows at a time, in float32, so no
    (B, T, V) log-softmax tensor is ever materialised. Apply any sampling temperature to the
    logits first (logits / temperature), as the engine sampled with it.
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids has shape {tuple(token_ids.shape)}, expected {tuple(logits.shape[:-1])} "
            f"(logits are {tuple(logits.shape)})"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1, 1)
    parts = []
    for chunk, chunk_ids in zip(_row_chunks(flat, chunk_size), ids.split(chunk_size, dim=0), strict=True):
        picked = chunk.gather(-1, chunk_ids).squeeze(-1).float()
        parts.append(picked - torch.logsumexp(chunk.float(), -1))
    if not parts:
        return flat.new_zeros(token_ids.shape, dtype=torch.float32)
    return torch.cat(parts).reshape(token_ids.shape)
