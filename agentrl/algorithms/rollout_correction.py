"""Off-policy correction against the behaviour policy: truncated importance weights on the engine's log-probs.

The rollout engine samples with the behaviour policy pi_b (its log-probs are `rollout_log_probs`); the
trainer recomputes the same tokens' log-probs before the update, pi_old (`old_log_probs`). The two differ
when the engine is stale (asynchronous training) or computes differently (bf16 kernels vs the trainer's
fp32). Decoupled PPO (Fu et al. 2025, AReaL) keeps the PPO clip on pi_theta / pi_old, pi_old acting as the
proximal policy, and multiplies each token's policy-gradient loss by a detached behaviour weight; the
weight is truncated at `cap` (truncated IS, Yao et al. 2025, as verl implements it):

    token:     w_{i,t} = min(exp(old_{i,t} - rollout_{i,t}), cap)
    sequence:  w_i     = min(exp(sum_t m_{i,t} (old_{i,t} - rollout_{i,t})), cap), on every token of row i

Config: `algorithm.rollout_correction.tis_mode` (None = off) and `algorithm.rollout_correction.tis_cap`.
Formulas and when to use it: docs/algorithms.md, "Off-policy correction (rollout_correction)".
"""

from __future__ import annotations

import math

import torch

from agentrl.algorithms._masked import as_bool_mask, masked_mean, masked_sum

__all__ = ["TIS_MODES", "behaviour_weights"]

TIS_MODES = ("token", "sequence")
"""Valid values of `algorithm.rollout_correction.tis_mode` besides None (off)."""

_MAX_LOG_RATIO = 20.0
"""A log-ratio is clamped to at most 20 before exp (only matters when tis_cap > e^20), so nothing overflows."""


def behaviour_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str | None,
    cap: float = 2.0,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_old / pi_behaviour, and the engine-vs-trainer mismatch metrics.

    old_log_probs, rollout_log_probs: (B, T) float, log pi_old and log pi_behaviour of the sampled tokens;
    response_mask: (B, T) bool. `mode` is None (no weights), "token" or "sequence" (a sequence is a row);
    `cap` > 0 truncates the weights. Returns

      weights: (B, T) detached float, None when `mode` is None. Token mode: w = min(exp(old - rollout),
        cap) per token; sequence mode: w_i = min(exp(sum_t (old - rollout)), cap) over row i's valid
        tokens, broadcast to them. 1 under the mask (a neutral factor; masked positions are never read).
      metrics: detached scalars under their logged names, over valid positions only:
        rollout_corr/log_ratio_mean   mean of old - rollout over valid tokens
        rollout_corr/kl_k3            mean of exp(r) - 1 - r, r = old - rollout: the k3 estimator of
                                      KL(pi_behaviour || pi_old) on tokens sampled from pi_behaviour
                                      (verl's k3_kl); >= 0, 0 when engine and trainer agree
      and, when `mode` is set (token mode over valid tokens, sequence mode over rows with a valid token):
        rollout_corr/is_weight_mean   mean weight (after truncation)
        rollout_corr/is_weight_max    largest weight (after truncation)
        rollout_corr/capped_frac      share whose untruncated weight reached `cap`
    An empty mask gives 0 for every metric. Values under the mask (NaN included) never reach a result.
    """
    if mode is not None and mode not in TIS_MODES:
        raise ValueError(
            f"unknown tis_mode {mode!r} (algorithm.rollout_correction.tis_mode); allowed: None, {', '.join(TIS_MODES)}"
        )
    if not cap > 0:
        raise ValueError(f"tis_cap must be > 0 (algorithm.rollout_correction.tis_cap), got {cap}")
    mask = as_bool_mask(response_mask, old_log_probs, "response_mask")
    if rollout_log_probs.shape != old_log_probs.shape:
        raise ValueError(
            f"rollout_log_probs has shape {tuple(rollout_log_probs.shape)}, expected {tuple(old_log_probs.shape)}"
        )
    with torch.no_grad():
        log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
        r = torch.clamp(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        # expm1(r) - r: the naive exp(r) - 1 - r cancels to noise in float32 at the ~1e-4 gaps of a healthy run.
        k3 = torch.clamp(torch.expm1(r) - r, min=0.0)
        metrics = {
            "rollout_corr/log_ratio_mean": masked_mean(log_ratio, mask),
            "rollout_corr/kl_k3": masked_mean(k3, mask),
        }
        if mode is None:
            return None, metrics
        log_cap = math.log(cap)
        if mode == "token":
            log_w, valid = log_ratio, mask
        else:
            log_w, valid = masked_sum(log_ratio, mask, dim=-1), mask.any(dim=-1)
        capped = valid & (log_w >= log_cap)
        w = torch.where(
            capped, torch.full_like(log_w, cap), torch.exp(torch.clamp(log_w, max=_MAX_LOG_RATIO))
        )
        metrics["rollout_corr/is_weight_mean"] = masked_mean(w, valid)
        # max over the valid weights, 0 when there are none (weights are >= 0)
        metrics["rollout_corr/is_weight_max"] = torch.cat(
            [torch.where(valid, w, 0.0).flatten(), w.new_zeros(1)]
        ).max()
        metrics["rollout_corr/capped_frac"] = masked_mean(capped.float(), valid)
        if mode == "sequence":
            w = w.unsqueeze(-1).expand_as(log_ratio)
        weights = torch.where(mask, w, torch.ones_like(log_ratio))
    return weights, metrics
