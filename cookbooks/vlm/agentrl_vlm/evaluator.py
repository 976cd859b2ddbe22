"""Score a count: 1.0 when the first digit of the answer is the number of shapes."""

from __future__ import annotations

import re

from agentrl import EvalOutput, Evaluator

_DIGIT = re.compile(r"\d")


def first_digit(text: str | None) -> str | None:
    match = _DIGIT.search(text or "")
    return match.group(0) if match else None


class CountEvaluator(Evaluator):
    """1.0 for the right count, `format_reward` for any other single digit, else 0."""

    def __init__(self, format_reward: float = 0.0) -> None:
        self.format_reward = format_reward

    def evaluate(self, task, episode) -> EvalOutput:
        answer = first_digit(episode.answer)
        correct = answer == str(task["reward_model"]["ground_truth"])
        reward = 1.0 if correct else (self.format_reward if answer is not None else 0.0)
        return EvalOutput(reward=reward, is_correct=correct, metrics={"answered": float(answer is not None)})
