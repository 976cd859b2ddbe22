"""Advantage estimators behind a registry: `algorithm.adv_estimator` names one of them.

Every estimator is a pure function with the same keyword signature (see `compute_advantages`) and
returns `AdvantageResult(advantages (B, T), returns (B, T))`, zero wherever `response_mask` is False.
Rows are response tokens: B sequences, T token positions; `response_mask` (B, T) bool marks tokens
the policy produced (observation and padding tokens are False and are skipped, not zero-rewarded).

Users add an estimator with the decorator; the name then becomes a valid `algorithm.adv_estimator`:

    @register_advantage_estimator("my_estimator")
    def compute_my_advantages(*, token_rewards, response_mask, group_ids, **_):
        ...
        return AdvantageResult(advantages, returns)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from agentrl.algorithms._masked import as_bool_mask, group_mean_std, index_groups, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageResult",
    "compute_advantages",
    "compute_discounted_returns",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "register_advantage_estimator",
]


class AdvantageResult(NamedTuple):
    """advantages (B, T) and returns (B, T) float; both 0 where `response_mask` is False."""

    advantages: torch.Tensor
    returns: torch.Tensor


AdvantageEstimator = Callable[..., AdvantageResult]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Name -> estimator. `register_advantage_estimator` adds to it; the config validates against its keys."""


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that registers an estimator under `name` (an existing name is an error).

    The function must accept the keywords of `compute_advantages` (take what it needs, swallow the
    rest with `**_`) and return an `AdvantageResult`.
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is already registered (to {ADVANTAGE_ESTIMATORS[name].__name__})"
            )
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def compute_advantages(
    name: str,
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
    sample_ids: torch.Tensor | None = None,
) -> AdvantageResult:
    """Run the estimator registered as `name` (the value of `algorithm.adv_estimator`).

    token_rewards: (B, T) float, reward of each response token (an outcome reward sits on the
        last valid token of its row). response_mask: (B, T) bool, True on policy tokens.
    group_ids: (B,) long, rows sampled from the same prompt share an id (the GRPO/RLOO group).
    values: (B, T) float critic values, needed by `gae` only.
    sample_ids: (B,) long, optional; rows with the same id are one sample (a trajectory split into
        several rows). The group estimators (grpo, rloo, reinforce_plus_plus_baseline) then count
        it once in its group, with the mean of its rows' scores, and give each of its rows the
        sample's advantage. Default: every row is a sample.
    gamma, lam: discount and GAE lambda (`algorithm.gamma`, `algorithm.lam`).
    norm_adv_by_std_in_grpo: divide by the group std in `grpo` (`algorithm.norm_adv_by_std_in_grpo`).
    eps: added to the group std in `grpo` so that a group of equal scores gives 0, not NaN.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r} (algorithm.adv_estimator); "
            f"known: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
        )
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be (B, T), got shape {tuple(token_rewards.shape)}")
    mask = as_bool_mask(response_mask, token_rewards, "response_mask")
    if group_ids.shape != token_rewards.shape[:1]:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)}, expected ({token_rewards.shape[0]},)"
        )
    if values is not None and values.shape != token_rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(token_rewards.shape)}")
    if sample_ids is not None and sample_ids.shape != group_ids.shape:
        raise ValueError(f"sample_ids has shape {tuple(sample_ids.shape)}, expected {tuple(group_ids.shape)}")
    return ADVANTAGE_ESTIMATORS[name](
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=group_ids,
        values=values,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        eps=eps,
        sample_ids=sample_ids,
    )


def _zero_where_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _broadcast_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence value -> (B, T), placed on every valid token."""
    return _zero_where_masked(scores.unsqueeze(-1).expand(mask.shape), mask)


def _sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,): the outcome score of a row is the sum of its valid token rewards."""
    return _zero_where_masked(token_rewards, mask).sum(-1)


def _sample_scores(
    scores: torch.Tensor, group_ids: torch.Tensor, sample_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row scores (B,) -> (sample scores (N,), sample group ids (N,), row -> sample index (B,)).

    A sample's score is the mean of its rows' scores (a trajectory split into rows carries its
    outcome on each row). Without `sample_ids` every row is its own sample.
    """
    if sample_ids is None:
        return scores, group_ids, torch.arange(scores.numel(), device=scores.device)
    row_sample, num_samples = index_groups(sample_ids)
    count = torch.bincount(row_sample, minlength=num_samples).to(scores.dtype)
    sample_scores = torch.zeros(num_samples, dtype=scores.dtype, device=scores.device)
    sample_scores = sample_scores.index_add_(0, row_sample, scores) / count
    rows = torch.arange(scores.numel(), device=scores.device)
    first_row = torch.full((num_samples,), scores.numel(), dtype=torch.long, device=scores.device)
    first_row = first_row.scatter_reduce(0, row_sample, rows, reduce="amin")
    sample_groups = group_ids[first_row]
    if bool((sample_groups[row_sample] != group_ids).any()):
        raise ValueError("rows with the same sample_ids must have the same group_ids (one sample, one group)")
    return sample_scores, sample_groups, row_sample


def _group_stats_verl(scores: torch.Tensor, group_ids: torch.Tensor):
    """(count, mean, unbiased std), each (B,), with verl's convention for a group of one: mean 0, std 1."""
    inverse, num_groups = index_groups(group_ids)
    count, mean, std = group_mean_std(scores, inverse, num_groups)
    lone = count == 1
    return (
        count,
        torch.where(lone, torch.zeros_like(mean), mean),
        torch.where(lone, torch.ones_like(std), std),
    )


def compute_discounted_returns(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    reset_at_masked: bool = False,
) -> torch.Tensor:
    """Reward-to-go over valid tokens: G_t = r_t + gamma * G_{t'} with t' the next valid token.

    token_rewards: (B, T) float; response_mask: (B, T) bool. Returns (B, T), 0 on masked positions.
    By default masked positions are skipped: they add no reward and no discount step, so an
    observation between two assistant turns does not break or shrink the return (Sutton & Barto,
    eq. 3.8). With `reset_at_masked` the running return restarts at 0 at every masked position
    (verl's REINFORCE++ multiplies it by the mask), so a reward after a masked gap does not reach
    the tokens before it: G_t = r_t + gamma * G_{t+1} * m_{t+1}.
    """
    mask = as_bool_mask(response_mask, token_rewards, "response_mask")
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    reset = torch.zeros_like(running)
    for t in reversed(range(token_rewards.shape[1])):
        carried = reset if reset_at_masked else running
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, carried)
        returns[:, t] = running
    return _zero_where_masked(returns, mask)


@register_advantage_estimator("gae")
def compute_gae_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    **_,
) -> AdvantageResult:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), masked.

    token_rewards, values: (B, T) float; response_mask: (B, T) bool.
        delta_t = r_t + gamma * V_{t'} - V_t          (t' = next valid token; V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A + V                               (the critic's regression target)
    Masked positions are skipped: the recursion carries `A` and `V_{t'}` across them unchanged.
    With `whiten` (the default, as in verl) the advantages are then shifted and scaled to zero mean
    and unit variance over all valid tokens of the batch; returns use the raw advantages.
    Returns (B, T) tensors, 0 on masked positions.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (values=(B, T) tensor)")
    mask = response_mask
    values = _zero_where_masked(values, mask)
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    last_gae = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        valid = mask[:, t]
        last_gae = torch.where(valid, gae_t, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = _zero_where_masked(advantages, mask)
    returns = _zero_where_masked(advantages + values, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return AdvantageResult(advantages, returns)


@register_advantage_estimator("grpo")
def compute_grpo_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
    sample_ids: torch.Tensor | None = None,
    **_,
) -> AdvantageResult:
    """Group-relative outcome advantage (GRPO, Shao et al. 2024, arXiv:2402.03300).

    token_rewards: (B, T) float; response_mask: (B, T) bool; group_ids: (B,) long.
        s_i = sum_t r_{i,t}                                   (outcome score of row i)
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)            (std: unbiased, within i's group g)
        A_i = s_i - mean_g(s)                                  when norm_adv_by_std_in_grpo=False
    (the second form is Dr. GRPO, Liu et al. 2025, arXiv:2503.20783). A_i is placed on every valid
    token of row i. A group of one is treated as verl does: mean 0 and std 1, so A_i = s_i / (1 + eps)
    (A_i = s_i without the std). With `sample_ids` the statistics count each sample once (see
    `compute_advantages`). Returns (B, T) advantages and returns equal to them (verl's convention
    for outcome estimators).
    """
    scores, groups, row_sample = _sample_scores(
        _sequence_scores(token_rewards, response_mask), group_ids, sample_ids
    )
    count, mean, std = _group_stats_verl(scores, groups)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + eps)
    advantages = _broadcast_scores(adv[row_sample], response_mask)
    return AdvantageResult(advantages, advantages.clone())


@register_advantage_estimator("rloo")
def compute_rloo_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    **_,
) -> AdvantageResult:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    token_rewards: (B, T) float; response_mask: (B, T) bool; group_ids: (B,) long.
        A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j  =  n / (n - 1) * (s_i - mean_g(s))
    with s_i the summed token reward of row i and n its group's size. A group of one keeps its
    score, A_i = s_i (verl: baseline 0). `sample_ids` as in `compute_advantages`.
    Placed on every valid token; returns equal the advantages.
    """
    scores, groups, row_sample = _sample_scores(
        _sequence_scores(token_rewards, response_mask), group_ids, sample_ids
    )
    count, mean, _std = _group_stats_verl(scores, groups)
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    advantages = _broadcast_scores(adv[row_sample], response_mask)
    return AdvantageResult(advantages, advantages.clone())


@register_advantage_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, **_
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns whitened across the batch.

    token_rewards: (B, T) float; response_mask: (B, T) bool.
        G_t = r_t + gamma * G_{t+1} * m_{t+1},   A = (G - mean(G)) / sqrt(var(G) + 1e-8)
    with mean and unbiased variance over all valid tokens of the batch (a global, not per-group,
    baseline). As in verl the running return restarts at every masked position, so it does not
    carry across an observation gap (`compute_discounted_returns(reset_at_masked=True)`).
    Returns (advantages, G), both (B, T).
    """
    returns = compute_discounted_returns(token_rewards, response_mask, gamma, reset_at_masked=True)
    return AdvantageResult(masked_whiten(returns, response_mask), returns)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    **_,
) -> AdvantageResult:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv:2501.03262; verl's formula).

    token_rewards: (B, T) float; response_mask: (B, T) bool; group_ids: (B,) long.
        a_i = s_i - mean_g(s)            (a group of one: mean 0, as verl)
        A   = whiten(a_i on every valid token of row i)   over all valid tokens of the batch
    so, like REINFORCE++, the scale is set by the whole batch, while the baseline is the group's.
    `sample_ids` as in `compute_advantages`. Returns (B, T) advantages and returns equal to them.
    """
    scores, groups, row_sample = _sample_scores(
        _sequence_scores(token_rewards, response_mask), group_ids, sample_ids
    )
    _count, mean, _std = _group_stats_verl(scores, groups)
    centred = _broadcast_scores((scores - mean)[row_sample], response_mask)
    advantages = masked_whiten(centred, response_mask)
    return AdvantageResult(advantages, advantages.clone())


@register_advantage_estimator("reinforce")
def compute_reinforce_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, **_
) -> AdvantageResult:
    """Plain REINFORCE (Williams 1992): the advantage is the discounted return, with no baseline.

    token_rewards: (B, T) float; response_mask: (B, T) bool. A_t = G_t = r_t + gamma * G_{t'}.
    Returns (B, T) advantages and returns (equal).
    """
    returns = compute_discounted_returns(token_rewards, response_mask, gamma)
    return AdvantageResult(returns, returns.clone())
