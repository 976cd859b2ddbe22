"""Step-wise advantages for multi-step agents (rLLM's `stepwise_advantage`).

A multi-step agent produces, per task, n trajectories of several steps each; every step is one
model call and becomes one training row. `agent.stepwise_advantage.mode` says how a step gets its
advantage (a scalar per step; the controller puts it on the step's response tokens):

- `broadcast`: the trajectory is judged as a whole. Its reward is compared with the other
  trajectories of the same task (group) by the outcome estimator (`algorithm.adv_estimator`), and
  the resulting trajectory advantage is copied to every one of its steps.
- `per_step`: each step is a sample of its own. Its reward is the discounted return from that
  step on within its trajectory, G_k = r_k + gamma * G_{k+1}, and it is compared with the steps
  at the same position k of the other trajectories of its task (group key: (task, k)). A position
  only one trajectory reached is a group of one, which the estimator treats as verl does (GRPO:
  the step keeps its return as advantage).

`normalize_by_steps` belongs to `broadcast`, as in rLLM: the trajectory's advantage is divided by
its number of steps, so a long trajectory does not weigh more in the loss than a short one just
by having more steps.

Layout: N trajectories and S steps in total. `step_traj_index` (S,) long gives each step's
trajectory (0..N-1); the steps of one trajectory appear in time order (not necessarily next to
each other). `traj_group_ids` (N,) long gives each trajectory's group (its task).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentrl.algorithms.advantages import compute_advantages

__all__ = [
    "STEPWISE_MODES",
    "StepAdvantageResult",
    "broadcast_advantages",
    "build_per_step_group_ids",
    "compute_broadcast_step_advantages",
    "compute_per_step_advantages",
    "compute_step_counts",
    "compute_step_positions",
    "compute_step_returns",
]

STEPWISE_MODES = ("broadcast", "per_step")
"""Valid values of `agent.stepwise_advantage.mode`."""


class StepAdvantageResult(NamedTuple):
    """advantages (S,) and returns (S,) float, one scalar per step."""

    advantages: torch.Tensor
    returns: torch.Tensor


def _check_index(step_traj_index: torch.Tensor, num_trajectories: int) -> None:
    if step_traj_index.dim() != 1:
        raise ValueError(f"step_traj_index must be 1-D (S,), got shape {tuple(step_traj_index.shape)}")
    if step_traj_index.numel() and (
        int(step_traj_index.min()) < 0 or int(step_traj_index.max()) >= num_trajectories
    ):
        raise ValueError(
            f"step_traj_index values must lie in [0, {num_trajectories}) (one per trajectory), "
            f"got range [{int(step_traj_index.min())}, {int(step_traj_index.max())}]"
        )


def compute_step_counts(step_traj_index: torch.Tensor, num_trajectories: int) -> torch.Tensor:
    """Number of steps of each trajectory: step_traj_index (S,) long -> (N,) long."""
    _check_index(step_traj_index, num_trajectories)
    return torch.bincount(step_traj_index, minlength=num_trajectories)


def compute_step_positions(step_traj_index: torch.Tensor) -> torch.Tensor:
    """Position k = 0, 1, ... of each step within its trajectory: (S,) long -> (S,) long."""
    seen: dict[int, int] = {}
    positions = []
    for traj in step_traj_index.tolist():
        positions.append(seen.get(traj, 0))
        seen[traj] = positions[-1] + 1
    return torch.tensor(positions, dtype=torch.long, device=step_traj_index.device)


def compute_step_returns(
    step_rewards: torch.Tensor, step_traj_index: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """Monte-Carlo return of each step within its trajectory: G_k = r_k + gamma * G_{k+1}.

    step_rewards: (S,) float; step_traj_index: (S,) long. Returns (S,). An outcome reward put on
    the last step reaches step k as gamma^(K-1-k) * reward, K the trajectory's step count.
    """
    if step_rewards.shape != step_traj_index.shape:
        raise ValueError(
            f"step_traj_index has shape {tuple(step_traj_index.shape)}, expected {tuple(step_rewards.shape)}"
        )
    running: dict[int, float] = {}
    out = [0.0] * step_rewards.numel()
    rewards = step_rewards.tolist()
    trajs = step_traj_index.tolist()
    for s in reversed(range(len(rewards))):
        running[trajs[s]] = rewards[s] + gamma * running.get(trajs[s], 0.0)
        out[s] = running[trajs[s]]
    return torch.tensor(out, dtype=step_rewards.dtype, device=step_rewards.device)


def build_per_step_group_ids(
    step_traj_index: torch.Tensor, traj_group_ids: torch.Tensor, step_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Group id (S,) long of each step for `per_step`: steps share a group when they come from the
    same task (traj_group_ids (N,)) and sit at the same position k in their trajectories.

    step_positions: (S,) long, each step's index in its trajectory; give it when some steps were
    left out (their positions stay), else it is counted from `step_traj_index`.
    """
    _check_index(step_traj_index, traj_group_ids.numel())
    if step_positions is None:
        step_positions = compute_step_positions(step_traj_index)
    elif step_positions.shape != step_traj_index.shape:
        raise ValueError(
            f"step_positions has shape {tuple(step_positions.shape)}, expected {tuple(step_traj_index.shape)}"
        )
    keys = torch.stack([traj_group_ids[step_traj_index].long(), step_positions.long()], dim=1)
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=step_traj_index.device)
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def broadcast_advantages(
    traj_advantages: torch.Tensor,
    step_traj_index: torch.Tensor,
    *,
    normalize_by_steps: bool = False,
    traj_num_steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy each trajectory's advantage to its steps: traj_advantages (N,), step_traj_index (S,) -> (S,).

    A_step = A_traj, or A_traj / K_traj with `normalize_by_steps`. K_traj is `traj_num_steps` (N,)
    when given (when the entries of `step_traj_index` are rows that may merge several steps),
    else the number of entries of the trajectory in `step_traj_index`.
    """
    num_trajectories = traj_advantages.numel()
    _check_index(step_traj_index, num_trajectories)
    step_adv = traj_advantages[step_traj_index]
    if normalize_by_steps:
        counts = traj_num_steps
        if counts is None:
            counts = compute_step_counts(step_traj_index, num_trajectories)
        elif counts.shape != traj_advantages.shape:
            raise ValueError(
                f"traj_num_steps has shape {tuple(counts.shape)}, expected {tuple(traj_advantages.shape)}"
            )
        step_adv = step_adv / counts[step_traj_index].clamp(min=1).to(step_adv.dtype)
    return step_adv


def _compute_scalar_advantages(
    estimator: str, rewards: torch.Tensor, group_ids: torch.Tensor, norm_adv_by_std_in_grpo: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an outcome estimator on one scalar reward per sample (as rows of one token)."""
    if estimator == "gae":
        raise ValueError(
            "agent.stepwise_advantage needs an outcome estimator (grpo, rloo, reinforce, "
            "reinforce_plus_plus); 'gae' needs token-level critic values"
        )
    rows = rewards.reshape(-1, 1)
    result = compute_advantages(
        estimator,
        token_rewards=rows,
        response_mask=torch.ones_like(rows, dtype=torch.bool),
        group_ids=group_ids,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        eps=eps,
    )
    return result.advantages.reshape(-1), result.returns.reshape(-1)


def compute_broadcast_step_advantages(
    traj_rewards: torch.Tensor,
    traj_group_ids: torch.Tensor,
    step_traj_index: torch.Tensor,
    *,
    estimator: str = "grpo",
    norm_adv_by_std_in_grpo: bool = True,
    normalize_by_steps: bool = False,
    traj_num_steps: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> StepAdvantageResult:
    """`broadcast` mode: trajectory-level advantage from the final reward, copied to every step.

    traj_rewards: (N,) float (each trajectory's reward); traj_group_ids: (N,) long;
    step_traj_index: (S,) long. A_traj = estimator(traj_rewards, groups) (e.g. GRPO:
    (R - mean_g R) / (std_g R + eps)); A_step = A_traj, or A_traj / K_traj with
    `normalize_by_steps` (K_traj: `traj_num_steps` (N,), see `broadcast_advantages`).
    Returns (S,) tensors.
    """
    adv, ret = _compute_scalar_advantages(
        estimator, traj_rewards, traj_group_ids, norm_adv_by_std_in_grpo, eps
    )
    return StepAdvantageResult(
        broadcast_advantages(
            adv, step_traj_index, normalize_by_steps=normalize_by_steps, traj_num_steps=traj_num_steps
        ),
        broadcast_advantages(ret, step_traj_index),
    )


def compute_per_step_advantages(
    step_rewards: torch.Tensor,
    step_traj_index: torch.Tensor,
    traj_group_ids: torch.Tensor,
    *,
    estimator: str = "grpo",
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    step_positions: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> StepAdvantageResult:
    """`per_step` mode: each step is a sample, compared with the same step of its siblings.

    step_rewards: (S,) float (reward of each step; an outcome-only task puts it on the last step);
    step_traj_index: (S,) long; traj_group_ids: (N,) long; step_positions: (S,) long, optional
    (see `build_per_step_group_ids`).
        G_k    = r_k + gamma * G_{k+1}                       (`compute_step_returns`)
        A_k    = estimator(G, groups = (task, k))            (e.g. GRPO over the k-th steps)
    A position that only one trajectory of a task reached forms a group of one; grpo gives it
    G_k / (1 + eps) and rloo G_k (verl's mean 0, std 1). Returns advantages (S,) and returns G (S,).
    """
    returns = compute_step_returns(step_rewards, step_traj_index, gamma=gamma)
    group_ids = build_per_step_group_ids(step_traj_index, traj_group_ids, step_positions)
    adv, _ = _compute_scalar_advantages(estimator, returns, group_ids, norm_adv_by_std_in_grpo, eps)
    return StepAdvantageResult(adv, returns)
