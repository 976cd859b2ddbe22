"""Evaluator: scores what a flow did. Built-in graders for final-answer math tasks live here too.

An evaluator may return a float, a bool or an `EvalOutput`; `score_episode` normalises all three and turns a
raising evaluator or a NaN reward into a recorded evaluator error, so one bad score never crashes a run and
never becomes a made-up reward that is trained on.
"""

from __future__ import annotations

import inspect
import math
import re
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from agentrl.tracking.failures import record_failure
from agentrl.types import Episode, EvalOutput, Task

EVAL_METRIC_PREFIX = "eval/"
"""Evaluator metrics are stored on the episode under this prefix and logged as `batch/<name>`, `val/<name>`."""


class Evaluator(ABC):
    """Base class: `evaluate(task, episode)` returns a float, a bool or an EvalOutput."""

    @abstractmethod
    def evaluate(self, task: Task, episode: Episode) -> EvalOutput | float | bool:
        """Score one episode of one task."""


class _FunctionEvaluator(Evaluator):
    def __init__(self, fn: Callable[[Task, Episode], Any]) -> None:
        self._fn = fn
        self.__doc__ = fn.__doc__

    def evaluate(self, task: Task, episode: Episode) -> Any:
        return self._fn(task, episode)

    def __repr__(self) -> str:
        return f"evaluator({self._fn.__qualname__})"


def evaluator(fn: Callable[[Task, Episode], Any]) -> Evaluator:
    """Turn `def fn(task, episode) -> float | bool | EvalOutput` into an Evaluator."""
    if inspect.iscoroutinefunction(fn):
        raise TypeError("@evaluator takes a plain (non-async) function of (task, episode)")
    return _FunctionEvaluator(fn)


def to_eval_output(value: Any) -> EvalOutput:
    """Normalise an evaluator's return value; raise ValueError on NaN or a wrong type."""
    if not isinstance(value, (EvalOutput, bool, int, float)) and type(value).__module__ in ("numpy", "torch"):
        value = value.item()  # numpy / torch scalars (`pred == truth` on arrays gives np.bool_)
    if isinstance(value, EvalOutput):
        out = value
    elif isinstance(value, bool):
        out = EvalOutput(reward=float(value), is_correct=value)
    elif isinstance(value, (int, float)):
        out = EvalOutput(reward=float(value))
    else:
        raise ValueError(f"an evaluator must return float, bool or EvalOutput, got {type(value).__name__}")
    if not math.isfinite(out.reward):
        raise ValueError(f"the evaluator returned a non-finite reward ({out.reward})")
    if out.is_correct is None:
        out = out.model_copy(update={"is_correct": out.reward > 0})
    return out


def score_episode(grader: Evaluator, task: Task, episode: Episode) -> Episode:
    """Fill the episode's reward and correctness; trajectory rewards the flow set are kept.

    A failing evaluator marks the episode with `metrics["evaluator_error"] = 1` and the error text, so the
    controller can exclude it from training instead of training on an invented reward; the console's line of
    the step counts it (`tracking/failures.py`).
    """
    try:
        result = to_eval_output(grader.evaluate(task, episode))
    except Exception as exc:  # noqa: BLE001 - any evaluator bug costs this episode only
        failed = f"evaluator failed: {exc!r}\n{traceback.format_exc()}"
        episode.error = (episode.error or "") + failed
        episode.metrics["evaluator_error"] = 1.0
        record_failure("evaluator_error", failed)
        return episode
    episode.reward = result.reward
    episode.is_correct = bool(result.is_correct)
    episode.metrics.update({f"{EVAL_METRIC_PREFIX}{k}": float(v) for k, v in result.metrics.items()})
    for trajectory in episode.trajectories:
        if trajectory.reward is None:
            trajectory.reward = result.reward
    return episode


_FINAL_MARK = re.compile(r"####\s*([^\n]*)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_answer(text: str | None) -> str | None:
    """The final answer of a math solution: after `####`, else in `\\boxed{}`, else the last number."""
    if not text:
        return None
    for pattern in (_FINAL_MARK, _BOXED):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_number(text: str | None) -> str | None:
    """'1,234.50' -> '1234.5'; non-numbers are stripped and lower-cased."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return cleaned.lower()
    return str(int(value)) if value.is_integer() else repr(value)


class MathAnswerMatch(Evaluator):
    """Reward 1 when the flow's final answer equals `reward_model.ground_truth` numerically.

    With `strict=True` only an answer after `####` counts (the GSM8K format); otherwise `\\boxed{}` or the
    last number in the text are accepted too.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def evaluate(self, task: Task, episode: Episode) -> EvalOutput:
        text = episode.answer or ""
        if self.strict:
            marks = _FINAL_MARK.findall(text)
            predicted = marks[-1].strip() if marks else None
        else:
            predicted = extract_final_answer(text)
        truth = str(task.get("reward_model", {}).get("ground_truth", ""))
        correct = predicted is not None and normalize_number(predicted) == normalize_number(truth)
        return EvalOutput(
            reward=float(correct), is_correct=correct, metrics={"has_answer": float(predicted is not None)}
        )
