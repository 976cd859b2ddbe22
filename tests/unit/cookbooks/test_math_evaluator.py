"""GSM8KEvaluator and the `####` answer extraction of the math cookbook (cookbooks/math/agentrl_math)."""

import math

import pytest
from agentrl_math import GSM8KEvaluator, extract_gsm8k_answer

from agentrl import Episode, Task
from agentrl.evaluator import score_episode


def _task(truth: str) -> Task:
    return Task(
        id="t0", data={"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": truth}}
    )


def _score(answer: str | None, truth: str, format_reward: float = 0.0):
    return GSM8KEvaluator(format_reward).evaluate(_task(truth), Episode(answer=answer))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48 + 24 = 72\n#### 72", "72"),
        ("#### 1,234", "1,234"),
        ("so she earned $10.\n#### $10", "10"),
        ("#### -5 degrees", "-5"),
        ("#### 3.75.", "3.75"),
        ("first #### 4\nthen #### 5", "5"),
        ("####\n 18", "18"),
        ("the answer is 72", None),
        ("#### seventy-two", None),
        ("####", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    ("answer", "truth", "reward"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $1,000.00", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("#### -12", "-12", 1.0),
        ("#### 12", "-12", 0.0),
        ("#### 0.5", ".5", 1.0),
        ("#### 71", "72", 0.0),
        ("72", "72", 0.0),
        ("She sold 72 clips.", "72", 0.0),
        ("#### 7.2", "72", 0.0),
        (None, "72", 0.0),
    ],
)
def test_reward_compares_the_number_after_the_mark(answer, truth, reward):
    out = _score(answer, truth)
    assert out.reward == reward
    assert out.is_correct is (reward == 1.0)
    assert out.metrics["correct"] == reward


def test_has_answer_metric():
    assert _score("#### 71", "72").metrics["has_answer"] == 1.0
    assert _score("#### 72", "72").metrics["has_answer"] == 1.0
    assert _score("I think 72", "72").metrics["has_answer"] == 0.0


def test_format_reward_only_for_a_wrong_number_after_the_mark():
    assert _score("#### 71", "72", format_reward=0.1).reward == 0.1
    assert _score("I think 72", "72", format_reward=0.1).reward == 0.0
    assert _score("#### 72", "72", format_reward=0.1).reward == 1.0
    out = _score("#### 71", "72", format_reward=0.1)
    assert out.is_correct is False


@pytest.mark.parametrize("bad", [-0.1, 1.0, math.nan])
def test_format_reward_out_of_range(bad):
    with pytest.raises(ValueError, match="format_reward"):
        GSM8KEvaluator(format_reward=bad)


def test_missing_ground_truth_becomes_an_evaluator_error():
    task = Task(id="row-7", data={"prompt": [{"role": "user", "content": "q"}]})
    episode = score_episode(GSM8KEvaluator(), task, Episode(answer="#### 3"))
    assert episode.metrics["evaluator_error"] == 1.0
    assert "row-7" in episode.error and "ground_truth" in episode.error
    assert episode.reward == 0.0


def test_score_episode_takes_reward_and_metrics():
    episode = score_episode(GSM8KEvaluator(), _task("72"), Episode(answer="#### 72"))
    assert episode.reward == 1.0 and episode.is_correct
    assert episode.metrics["eval/has_answer"] == 1.0
