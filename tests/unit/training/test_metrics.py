"""Metrics the controller logs, computed from hand-built episodes."""

import math

from agentrl.training.metrics import (
    COLLAPSED_ENTROPY_SHARE,
    collapse_warning,
    compute_episode_metrics,
    compute_validation_metrics,
)
from agentrl.types import Episode, TerminationReason


def _episode(task_id: str, reward: float, **metrics: float) -> Episode:
    return Episode(
        task_id=task_id,
        task={"data_source": "toy"},
        reward=reward,
        is_correct=reward > 0,
        termination_reason=TerminationReason.ENV_DONE,
        metrics=dict(metrics),
    )


def test_episode_metrics_reward_solve_counts_and_evaluator_metrics():
    episodes = [
        _episode("a", 1.0, **{"eval/has_answer": 1.0}),
        _episode("a", 1.0, **{"eval/has_answer": 1.0}),
        _episode("b", 0.0, **{"eval/has_answer": 0.0}),
        _episode("b", 1.0, **{"eval/has_answer": 1.0}),
        _episode("c", 0.0, **{"eval/has_answer": 0.0}),
    ]
    metrics = compute_episode_metrics(episodes)
    assert metrics["critic/full-score/mean"] == 3 / 5
    # fractions of the 3 tasks: a all solved, b partially, c none
    assert (metrics["batch/solve_all"], metrics["batch/solve_partial"], metrics["batch/solve_none"]) == (
        1 / 3,
        1 / 3,
        1 / 3,
    )
    assert metrics["batch/num_tasks"] == 3
    assert metrics["batch/termination_reason/env_done"] == 1.0
    assert metrics["batch/has_answer"] == 3 / 5


def test_validation_metrics_per_data_source():
    episodes = [
        _episode("a", 1.0, **{"eval/has_answer": 1.0}),
        _episode("b", 0.0, **{"eval/has_answer": 0.0}),
    ]
    episodes[1].task = {"data_source": "other"}
    metrics = compute_validation_metrics(episodes)
    assert metrics["val/test_score/toy"] == 1.0 and metrics["val/test_score/other"] == 0.0
    assert metrics["val/accuracy"] == 0.5 and metrics["val/has_answer"] == 0.5


def test_collapse_warning_names_an_entropy_near_a_uniform_policy_only():
    uniform = math.log(2048)
    at = COLLAPSED_ENTROPY_SHARE * uniform
    warning = collapse_warning({"actor/entropy": at}, 2048, 7)
    assert warning.startswith("step 7: actor/entropy 6.86 is 90% of a uniform policy's ln(2048) = 7.62")
    assert "actor_rollout_ref.actor.optim.lr" in warning
    assert collapse_warning({"actor/entropy": at - 0.01}, 2048, 7) is None  # peaked enough
    assert collapse_warning({"actor/entropy": 1.2}, 151936, 3) is None  # a trained 0.5B policy
    assert collapse_warning({}, 2048, 1) is None  # no update this step
