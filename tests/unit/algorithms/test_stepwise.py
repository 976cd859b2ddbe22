"""Step-wise advantages: broadcast and per_step, with and without normalize_by_steps."""

import math

import pytest
import torch

from agentrl.algorithms import (
    STEPWISE_MODES,
    broadcast_advantages,
    build_per_step_group_ids,
    compute_broadcast_step_advantages,
    compute_per_step_advantages,
    compute_step_counts,
    compute_step_positions,
    compute_step_returns,
)

# Two tasks. Task 0: trajectories 0 (3 steps), 1 (1 step), 2 (2 steps). Task 1: trajectories 3, 4 (2 steps each).
TRAJ_GROUPS = torch.tensor([0, 0, 0, 1, 1])
STEP_TRAJ = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 4, 4])
S = 1 / math.sqrt(2)


def test_modes():
    assert STEPWISE_MODES == ("broadcast", "per_step")


def test_counts_and_positions_with_interleaved_steps():
    index = torch.tensor([1, 0, 1, 2, 0, 1])
    assert compute_step_positions(index).tolist() == [0, 0, 1, 0, 1, 2]
    assert compute_step_counts(index, 4).tolist() == [2, 3, 1, 0]


def test_broadcast_hand_computed():
    # trajectory rewards: task 0 [1, 0, 2] -> GRPO (mean 1, std 1) [0, -1, 1]; task 1 [1, 1] -> [0, 0]
    res = compute_broadcast_step_advantages(torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0]), TRAJ_GROUPS, STEP_TRAJ)
    expected = [0.0, 0.0, 0.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(res.advantages, torch.tensor(expected), atol=1e-5, rtol=0)
    # normalize_by_steps: trajectory 2 has 2 steps -> 1 / 2 each; trajectory 1 has 1 step -> -1
    res = compute_broadcast_step_advantages(
        torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0]), TRAJ_GROUPS, STEP_TRAJ, normalize_by_steps=True
    )
    expected = [0.0, 0.0, 0.0, -1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(res.advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_broadcast_advantages_plain():
    # A_traj = [3, -6]; trajectory 1 has 3 steps -> -2 each when normalized
    index = torch.tensor([0, 1, 1, 1])
    adv = torch.tensor([3.0, -6.0])
    assert broadcast_advantages(adv, index).tolist() == [3.0, -6.0, -6.0, -6.0]
    assert broadcast_advantages(adv, index, normalize_by_steps=True).tolist() == [3.0, -2.0, -2.0, -2.0]


def test_step_returns_hand_computed():
    # gamma 0.5, outcome on each trajectory's last step:
    # traj 0: [0, 0, 1] -> [0.25, 0.5, 1]; traj 1: [0] -> [0]; traj 2: [0, 2] -> [1, 2]
    # traj 3: [0, 1] -> [0.5, 1]; traj 4: [0.5, 0.5] -> [0.75, 0.5]
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.5, 0.5])
    returns = compute_step_returns(rewards, STEP_TRAJ, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([0.25, 0.5, 1.0, 0.0, 1.0, 2.0, 0.5, 1.0, 0.75, 0.5]))


def test_per_step_group_ids():
    # keys (task, position): (0,0) (0,1) (0,2) (0,0) (0,0) (0,1) (1,0) (1,1) (1,0) (1,1)
    ids = build_per_step_group_ids(STEP_TRAJ, TRAJ_GROUPS).tolist()
    assert ids[0] == ids[3] == ids[4]
    assert ids[1] == ids[5]
    assert ids[6] == ids[8] and ids[7] == ids[9]
    assert len(set(ids)) == 5


def test_per_step_hand_computed():
    # gamma 1 returns: traj 0 [1, 1, 1]; traj 1 [0]; traj 2 [2, 2]; traj 3 [1, 1]; traj 4 [1, 0.5]
    # groups (task, k): (0,0) [1, 0, 2] -> [0, -1, 1]; (0,1) [1, 2] -> [-1/sqrt2, 1/sqrt2];
    # (0,2) [1] singleton -> verl's mean 0, std 1: 1 / (1 + 1e-6); (1,0) [1, 1] -> [0, 0]; (1,1) [1, 0.5] -> [1/sqrt2, -1/sqrt2]
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.5, 0.5])
    res = compute_per_step_advantages(rewards, STEP_TRAJ, TRAJ_GROUPS, gamma=1.0)
    expected = torch.tensor([0.0, -S, 1.0, -1.0, 1.0, S, 0.0, S, 0.0, -S])
    torch.testing.assert_close(res.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.returns, torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.5]))


def test_per_step_positions_given_keep_their_place():
    # Trajectory 0 kept steps 0 and 2 (step 1 was excluded), trajectory 1 kept 0, 1, 2; one task.
    index, groups = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 0])
    counted = build_per_step_group_ids(index, groups).tolist()
    given = build_per_step_group_ids(index, groups, torch.tensor([0, 2, 0, 1, 2])).tolist()
    assert counted[1] == counted[3]  # counted positions pair trajectory 0's step 2 with step 1
    assert given[1] == given[4] and given[3] not in (given[0], given[1])
    with pytest.raises(ValueError, match="step_positions has shape"):
        build_per_step_group_ids(index, groups, torch.tensor([0, 1]))


def test_broadcast_normalize_by_steps_uses_given_step_counts():
    # two rows of trajectory 0 that hold 3 steps in all: divide by 3, not by the 2 rows
    adv = broadcast_advantages(
        torch.tensor([3.0, -6.0]),
        torch.tensor([0, 0, 1]),
        normalize_by_steps=True,
        traj_num_steps=torch.tensor([3, 2]),
    )
    assert adv.tolist() == [1.0, 1.0, -3.0]


def test_per_step_with_reinforce_uses_returns():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.5, 0.5])
    res = compute_per_step_advantages(rewards, STEP_TRAJ, TRAJ_GROUPS, estimator="reinforce", gamma=0.5)
    torch.testing.assert_close(res.advantages, res.returns)


def test_errors():
    with pytest.raises(ValueError, match="outcome estimator"):
        compute_per_step_advantages(torch.zeros(10), STEP_TRAJ, TRAJ_GROUPS, estimator="gae")
    with pytest.raises(ValueError, match=r"step_traj_index values must lie in \[0, 5\)"):
        broadcast_advantages(torch.zeros(5), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_broadcast_step_advantages(torch.zeros(5), TRAJ_GROUPS, STEP_TRAJ, estimator="nope")
