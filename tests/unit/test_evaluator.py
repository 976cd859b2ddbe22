"""Evaluators: return-value normalisation, failure handling, and the built-in math grader."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agentrl import Episode, EvalOutput, Evaluator, MathAnswerMatch, Task, Trajectory, evaluator
from agentrl.evaluator import extract_final_answer, normalize_number, score_episode, to_eval_output


def test_to_eval_output_float_bool_and_eval_output():
    assert to_eval_output(0.5) == EvalOutput(reward=0.5, is_correct=True)
    assert to_eval_output(0.0) == EvalOutput(reward=0.0, is_correct=False)
    assert to_eval_output(2) == EvalOutput(reward=2.0, is_correct=True)
    assert to_eval_output(True) == EvalOutput(reward=1.0, is_correct=True)
    assert to_eval_output(False) == EvalOutput(reward=0.0, is_correct=False)
    explicit = EvalOutput(reward=0.3, is_correct=False, metrics={"steps": 2.0})
    assert to_eval_output(explicit) == explicit
    assert to_eval_output(EvalOutput(reward=-1.0)).is_correct is False


def test_to_eval_output_accepts_numpy_and_torch_scalars():
    assert to_eval_output(np.bool_(True)) == EvalOutput(reward=1.0, is_correct=True)
    assert to_eval_output(np.float32(0.25)) == EvalOutput(reward=0.25, is_correct=True)
    assert to_eval_output(np.int64(0)) == EvalOutput(reward=0.0, is_correct=False)
    assert to_eval_output(torch.tensor(False)) == EvalOutput(reward=0.0, is_correct=False)
    with pytest.raises(ValueError, match="non-finite"):
        to_eval_output(np.float64("nan"))
    with pytest.raises((ValueError, RuntimeError)):
        to_eval_output(torch.tensor([1.0, 0.0]))  # not a scalar


@pytest.mark.parametrize("bad", [math.nan, math.inf, EvalOutput(reward=math.nan)])
def test_to_eval_output_non_finite_raises(bad):
    with pytest.raises(ValueError, match="non-finite"):
        to_eval_output(bad)


@pytest.mark.parametrize("bad", ["1.0", None, [1.0]])
def test_to_eval_output_wrong_type_names_it(bad):
    with pytest.raises(ValueError, match=type(bad).__name__):
        to_eval_output(bad)


def _episode(answer="4") -> Episode:
    return Episode(
        id="t:0",
        task_id="t",
        answer=answer,
        trajectories=[Trajectory(name="agent"), Trajectory(name="critic", reward=-0.25)],
    )


def test_score_episode_fills_reward_and_keeps_trajectory_rewards_the_flow_set():
    episode = score_episode(
        evaluator(lambda task, ep: EvalOutput(reward=1.0, metrics={"len": 3.0})), Task(id="t"), _episode()
    )
    assert (episode.reward, episode.is_correct) == (1.0, True)
    assert [t.reward for t in episode.trajectories] == [1.0, -0.25]
    assert episode.metrics["eval/len"] == 3.0
    assert "evaluator_error" not in episode.metrics


@pytest.mark.parametrize("result", ["raise", math.nan, "text"])
def test_score_episode_on_a_failing_evaluator_marks_the_episode_and_keeps_it(result):
    class Broken(Evaluator):
        def evaluate(self, task, episode):
            if result == "raise":
                raise KeyError("ground_truth")
            return result

    episode = _episode()
    out = score_episode(Broken(), Task(id="t"), episode)
    assert out is episode
    assert out.metrics["evaluator_error"] == 1.0
    assert "evaluator failed" in out.error
    assert (out.reward, out.is_correct) == (0.0, False)  # nothing invented
    assert out.trajectories[0].reward is None  # not filled with a made-up reward
    assert out.answer == "4" and len(out.trajectories) == 2


def test_evaluator_decorator_refuses_async_functions():
    async def grade(task, episode):
        return 1.0

    with pytest.raises(TypeError, match="non-async"):
        evaluator(grade)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1\nwait, #### 2 ", "2"),
        ("the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{-3}", "-3"),
        ("I have 3 apples and 12 pears", "12"),
        ("it costs $1,234.50 in total", "1,234.50"),
        ("no digits here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234.50", "1234.5"),
        ("$12", "12"),
        ("7.", "7"),
        ("-3.0", "-3"),
        (" Seven ", "seven"),
        (None, None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("answer", "truth", "strict", "correct", "has_answer"),
    [
        ("#### 72", "72", True, True, 1.0),
        ("so 72", "72", True, False, 0.0),  # strict: only an answer after #### counts
        ("so 72", "72", False, True, 1.0),
        ("\\boxed{1,000}", "1000", False, True, 1.0),
        ("#### 72.0", 72, False, True, 1.0),
        ("#### 71", "72", False, False, 1.0),
        ("", "72", False, False, 0.0),
        (None, "72", False, False, 0.0),
    ],
)
def test_math_answer_match(answer, truth, strict, correct, has_answer):
    task = Task(id="t", data={"reward_model": {"ground_truth": truth}})
    out = MathAnswerMatch(strict=strict).evaluate(task, Episode(answer=answer))
    assert out.reward == float(correct) and out.is_correct is correct
    assert out.metrics["has_answer"] == has_answer
