"""Metrics the controller logs, computed from hand-built episodes."""

from agentrl.training.metrics import compute_episode_metrics, compute_validation_metrics
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
