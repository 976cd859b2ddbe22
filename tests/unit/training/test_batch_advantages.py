"""Advantages over an assembled batch: token-level GRPO, step-wise broadcast and per_step, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.batch_advantages import compute_batch_advantages

A = 1 / math.sqrt(2)  # (1 - 0.5) / std([1, 0]) with the unbiased std sqrt(0.5)


def _row(
    reward: float,
    group: str,
    traj: str,
    prompt_len: int = 2,
    response_len: int = 2,
    steps: int = 1,
    index: int = 0,
) -> TrainingRow:
    n = prompt_len + response_len
    return TrainingRow(
        input_ids=list(range(1, n + 1)),
        response_mask=[0] * prompt_len + [1] * response_len,
        rollout_log_probs=[0.0] * n,
        reward=reward,
        group_key=group,
        trajectory_key=traj,
        num_steps=steps,
        step_index=index,
    )


def _advantages(rows, **kwargs):
    batch = rows_to_batch(rows, pad_token_id=0)
    options = dict(estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    return batch, compute_batch_advantages(batch, **(options | kwargs))


def test_grpo_token_level_by_hand():
    rows = [
        _row(1.0, "t0", "a"),
        _row(0.0, "t0", "b", response_len=3),
        _row(1.0, "t1", "c"),
        _row(1.0, "t1", "d"),
    ]
    batch, result = _advantages(rows)
    expected = torch.tensor(
        [
            [0, 0, A, A, 0],
            [0, 0, -A, -A, -A],
            [0, 0, 0, 0, 0],  # a group whose scores are equal has no signal
            [0, 0, 0, 0, 0],
        ]
    )
    assert torch.allclose(result.advantages, expected, atol=1e-5)
    assert (result.advantages[~batch.response_mask] == 0).all()


def test_grpo_without_std_normalisation_subtracts_the_group_mean():
    rows = [_row(1.0, "t0", "a"), _row(0.0, "t0", "b"), _row(0.5, "t0", "c")]
    _, result = _advantages(rows, norm_adv_by_std_in_grpo=False)
    assert torch.allclose(result.advantages[:, -1], torch.tensor([0.5, -0.5, 0.0]))


def test_broadcast_gives_every_row_of_a_trajectory_the_same_advantage():
    # Trajectory a (reward 1) was split into two rows (a non-extending step); b (reward 0) has one row.
    rows = [_row(1.0, "t0", "a"), _row(1.0, "t0", "a", prompt_len=3, response_len=1), _row(0.0, "t0", "b")]
    batch, result = _advantages(rows, stepwise_mode="broadcast")
    per_row = [result.advantages[i][batch.response_mask[i]].unique().tolist() for i in range(3)]
    assert per_row[0] == pytest.approx([A], abs=1e-5)
    assert per_row[1] == pytest.approx([A], abs=1e-5)
    assert per_row[2] == pytest.approx([-A], abs=1e-5)
    assert (result.advantages[~batch.response_mask] == 0).all()


def test_broadcast_normalize_by_steps_divides_by_the_trajectory_step_count():
    # a: 2 rows holding 3 steps -> A / 3 on both rows; b: 1 row, 1 step -> -A
    rows = [_row(1.0, "t0", "a", steps=3), _row(1.0, "t0", "a", steps=3), _row(0.0, "t0", "b")]
    _, result = _advantages(rows, stepwise_mode="broadcast", normalize_by_steps=True)
    assert result.advantages[:, -1].tolist() == pytest.approx([A / 3, A / 3, -A], abs=1e-5)


def test_normalize_by_steps_outside_broadcast_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="normalize_by_steps=true needs mode=broadcast"):
        _advantages([_row(1.0, "t0", "a")], stepwise_mode="per_step", normalize_by_steps=True)


def test_per_step_groups_steps_by_their_position():
    # Two trajectories of one task, two steps each (one row per step), gamma 0.5:
    #   a: rewards [0, 1] -> returns [0.5, 1];  b: rewards [1, 0] -> returns [1, 0].
    # Step 0 compares 0.5 with 1, step 1 compares 1 with 0: each pair gives -/+ 1/sqrt(2).
    rows = [
        _row(0.0, "t0", "a", steps=2, index=0),
        _row(1.0, "t0", "a", steps=2, index=1),
        _row(1.0, "t0", "b", steps=2, index=0),
        _row(0.0, "t0", "b", steps=2, index=1),
    ]
    _, result = _advantages(rows, stepwise_mode="per_step", gamma=0.5)
    assert result.advantages[:, -1].tolist() == pytest.approx([-A, A, A, -A], abs=1e-5)
    assert result.returns[:, -1].tolist() == pytest.approx([0.5, 1.0, 1.0, 0.0])


def test_unknown_stepwise_mode_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="agent.stepwise_advantage.mode"):
        _advantages([_row(1.0, "t0", "a")], stepwise_mode="per_token")
