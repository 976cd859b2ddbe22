"""Advantages for an assembled batch: token-level estimators on rows, or step-wise over trajectories.

- step-wise off: the estimator runs on rows, token by token (`gae` with critic values; `reinforce`/
  `reinforce_plus_plus` discount with `algorithm.gamma`). The group estimators (`grpo`, `rloo`,
  `reinforce_plus_plus_baseline`) compare trajectories, not rows: a trajectory split into several rows
  counts once in its task's group and every one of its rows gets its advantage.
- `broadcast`: one advantage per trajectory from its reward, compared across the task's trajectories, copied
  to every row (step) of the trajectory; `normalize_by_steps` divides it by the trajectory's step count.
- `per_step`: each step is a sample compared with the step at the same index of its sibling trajectories.
"""

from __future__ import annotations

import torch

from agentrl.algorithms.advantages import AdvantageResult, compute_advantages
from agentrl.algorithms.stepwise import compute_broadcast_step_advantages, compute_per_step_advantages
from agentrl.training.update.assembly import TrainBatch


def compute_batch_advantages(
    batch: TrainBatch,
    *,
    estimator: str,
    gamma: float,
    lam: float,
    norm_adv_by_std_in_grpo: bool,
    stepwise_mode: str | None = None,
    normalize_by_steps: bool = False,
) -> AdvantageResult:
    """(B, L) advantages and returns for `batch` (token rewards in `batch.token_rewards`)."""
    mask = batch.response_mask
    if stepwise_mode is None:
        return compute_advantages(
            estimator,
            token_rewards=batch.token_rewards,
            response_mask=mask,
            group_ids=batch.group_ids,
            values=batch.tensors.get("values"),
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            sample_ids=batch.trajectory_ids,
        )
    if normalize_by_steps and stepwise_mode != "broadcast":
        raise ValueError(
            f"agent.stepwise_advantage.normalize_by_steps=true needs mode=broadcast (got {stepwise_mode!r})"
        )
    row_scores = (batch.token_rewards * mask).sum(dim=1)
    traj_ids = batch.trajectory_ids
    num_traj = int(traj_ids.max()) + 1
    first_row = torch.full((num_traj,), len(batch), dtype=torch.long).scatter_reduce(
        0, traj_ids, torch.arange(len(batch)), reduce="amin"
    )
    traj_groups = batch.group_ids[first_row]
    if stepwise_mode == "broadcast":
        traj_rewards = torch.zeros(num_traj).index_add_(0, traj_ids, row_scores)
        traj_rewards /= torch.bincount(traj_ids, minlength=num_traj).clamp(min=1)
        result = compute_broadcast_step_advantages(
            traj_rewards,
            traj_groups,
            traj_ids,
            estimator=estimator,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            normalize_by_steps=normalize_by_steps,
            traj_num_steps=batch.num_steps[first_row],
        )
    elif stepwise_mode == "per_step":
        result = compute_per_step_advantages(
            row_scores,
            traj_ids,
            traj_groups,
            estimator=estimator,
            gamma=gamma,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            step_positions=batch.step_index,
        )
    else:
        raise ValueError(f"agent.stepwise_advantage.mode={stepwise_mode!r}; allowed: broadcast, per_step")
    return AdvantageResult(result.advantages[:, None] * mask, result.returns[:, None] * mask)
