"""Assembly: hand-built episodes with made-up token ids into rows, and rows into one padded batch."""

from __future__ import annotations

import pytest
import torch

from agentrl.training.update.assembly import TrainingRow, episodes_to_rows, rows_to_batch
from agentrl.types import Episode, Step, Trajectory

PAD = 0


def _step(prompt, response, logprobs=None, reward=0.0, **info) -> Step:
    logprobs = logprobs if logprobs is not None else [-0.5] * len(response)
    return Step(prompt_ids=prompt, response_ids=response, logprobs=logprobs, reward=reward, info=info)


def _episode(steps, *, task_id="t0", reward=1.0, index=0, name="agent", traj_reward=None) -> Episode:
    return Episode(
        id=f"{task_id}:{index}",
        task_id=task_id,
        reward=reward,
        trajectories=[Trajectory(name=name, steps=steps, reward=traj_reward)],
    )


def test_extending_steps_merge_into_one_row_with_mask_on_model_tokens():
    first = _step([1, 2, 3], [4, 5], [-0.1, -0.2])
    # The second prompt is prompt1 + completion1 + an observation (6, 7).
    second = _step([1, 2, 3, 4, 5, 6, 7], [8], [-0.3])
    rows, stats = episodes_to_rows([_episode([first, second], reward=0.75)])

    assert len(rows) == 1
    row = rows[0]
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.response_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert row.rollout_log_probs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert row.reward == 0.75
    assert (stats.rows, stats.merged_steps, stats.excluded_steps) == (1, 1, 0)


def test_non_extending_step_starts_a_new_row():
    first = _step([1, 2, 3], [4, 5])
    rewritten = _step([1, 2, 9, 4, 5, 6], [7])  # history was edited: not an extension
    third = _step([1, 2, 9, 4, 5, 6, 7, 10], [11])  # extends the second row
    rows, stats = episodes_to_rows([_episode([first, rewritten, third])])

    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6, 7, 10, 11]]
    assert [r.response_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 0, 1]]
    assert [r.step_index for r in rows] == [0, 1]
    assert all(r.num_steps == 3 for r in rows)
    assert rows[0].trajectory_key == rows[1].trajectory_key
    assert stats.merged_steps == 1


def test_per_step_gives_one_row_per_step_with_outcome_on_the_last():
    steps = [_step([1, 2], [3], reward=0.25), _step([1, 2, 3, 4], [5]), _step([1, 2, 3, 4, 5, 6], [7])]
    rows, stats = episodes_to_rows([_episode(steps, reward=1.0)], merge_steps=False)

    assert [r.input_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]]
    assert [r.response_mask for r in rows] == [[0, 0, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1]]
    # Step rewards are kept; the trajectory's outcome is added on its last step only.
    assert [r.reward for r in rows] == [0.25, 0.0, 1.0]
    assert [r.step_index for r in rows] == [0, 1, 2]
    assert stats.merged_steps == 0


def test_trajectory_reward_set_by_the_flow_beats_the_episode_reward():
    rows, _ = episodes_to_rows([_episode([_step([1], [2])], reward=1.0, traj_reward=-0.5)])
    assert rows[0].reward == -0.5


def test_excluded_and_logprob_mismatched_steps_are_skipped_and_counted():
    good = _step([1, 2], [3, 4], [-0.1, -0.2])
    flagged = _step([1, 2, 3, 4, 5], [6], excluded="trace_mismatch")
    short_logprobs = _step([1, 2, 3, 4, 5], [6, 7], [-0.1])  # 2 tokens, 1 logprob
    empty = Step()  # a step the flow declared but never filled
    episode = _episode([good, flagged, short_logprobs, empty])
    rows, stats = episodes_to_rows([episode])

    assert [r.input_ids for r in rows] == [[1, 2, 3, 4]]
    assert stats.excluded_steps == 3
    assert short_logprobs.info["excluded"] == "logprob_count_mismatch"


def test_rows_longer_than_max_length_are_truncated_and_counted():
    rows, stats = episodes_to_rows(
        [_episode([_step([1, 2, 3], [4, 5, 6], [-1.0, -2.0, -3.0])])], max_length=4
    )
    assert rows[0].input_ids == [1, 2, 3, 4]
    assert rows[0].response_mask == [0, 0, 0, 1]
    assert rows[0].rollout_log_probs == [0.0, 0.0, 0.0, -1.0]
    assert stats.truncated_rows == 1


def test_rows_to_batch_pads_puts_reward_on_last_response_token_and_densifies_ids():
    rows, _ = episodes_to_rows(
        [
            _episode([_step([5, 6], [7, 8], [-0.1, -0.2])], task_id="b", reward=1.0, index=0),
            _episode([_step([5], [9, 9, 9], [-0.3, -0.4, -0.5])], task_id="a", reward=0.5, index=0),
            _episode([_step([5, 6, 7], [4], [-0.6])], task_id="b", reward=0.0, index=1),
        ]
    )
    batch = rows_to_batch(rows, pad_token_id=PAD)

    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 9, 9], [5, 6, 7, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1]] * 3
    assert batch.response_mask.dtype == torch.bool
    assert batch.response_mask.tolist() == [
        [False, False, True, True],
        [False, True, True, True],
        [False, False, False, True],
    ]
    assert torch.allclose(
        batch.rollout_log_probs, torch.tensor([[0, 0, -0.1, -0.2], [0, -0.3, -0.4, -0.5], [0, 0, 0, -0.6]])
    )
    assert batch.token_rewards.tolist() == [[0, 0, 0, 1.0], [0, 0, 0, 0.5], [0, 0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.5, 0.0]
    # Dense ids in order of first appearance: task b -> 0, task a -> 1.
    assert batch.group_ids.tolist() == [0, 1, 0]
    assert batch.trajectory_ids.tolist() == [0, 1, 2]


def test_rows_to_batch_right_pads_shorter_rows():
    rows = [
        TrainingRow([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], [0, 0, -1, -1, 0], 2.0, "g", "t"),
        TrainingRow([1, 2], [0, 1], [0, -1], 3.0, "g", "u"),
    ]
    batch = rows_to_batch(rows, pad_token_id=PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # The reward sits on the last token the model produced, not on the last token of the row.
    assert batch.token_rewards.tolist() == [[0, 0, 0, 2.0, 0], [0, 3.0, 0, 0, 0]]
    assert batch.group_ids.tolist() == [0, 0]
    assert batch.trajectory_ids.tolist() == [0, 1]


def test_rows_to_batch_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="no training rows"):
        rows_to_batch([], pad_token_id=PAD)


def test_each_trained_step_gets_the_mean_advantage_of_its_row():
    from agentrl.training.update.assembly import write_step_advantages

    merged = _episode([_step([1, 2], [3, 4]), _step([1, 2, 3, 4, 5], [6])], task_id="t0")
    split = _episode([_step([1, 2], [3]), _step([9, 9], [7, 8])], task_id="t1")
    short = _step([1], [2, 3], logprobs=[-0.1])  # one logprob for two tokens: excluded, no row
    excluded = _episode([short], task_id="t2")
    episodes = [merged, split, excluded]
    rows, _ = episodes_to_rows(episodes)
    batch = rows_to_batch(rows, pad_token_id=PAD)
    # Row 0 (t0, merged): response tokens at positions 2, 3 and 5. Rows 1, 2: t1's two steps.
    advantages = torch.zeros_like(batch.rollout_log_probs)
    advantages[0, [2, 3, 5]] = torch.tensor([1.0, 2.0, 3.0])
    advantages[0, 4] = 100.0  # an observation token: not a response token, not counted
    advantages[1, 2] = -1.0
    advantages[2, 2:4] = torch.tensor([0.5, 1.5])
    batch["advantages"] = advantages
    write_step_advantages(episodes, batch)
    assert [s.advantage for s in merged.trajectories[0].steps] == [2.0, 2.0]
    assert [s.advantage for s in split.trajectories[0].steps] == [-1.0, 1.0]
    assert short.advantage is None
