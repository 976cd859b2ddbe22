"""Score a count: 1.0 when the answer is exactly the number of shapes (one digit, nothing after it)."""

from __future__ import annotations

import re

from agentrl import EvalOutput, Evaluator

_DIGIT = re.compile(r"\d")
_LONE_DIGIT = re.compile(r"[0-9]")


def first_digit(text: str | None) -> str | None:
    match = _DIGIT.search(text or "")
    return match.group(0) if match else None


class CountEvaluator(Evaluator):
    """1.0 for the right count, `format_reward` for a wrong one given in the same format, else 0.

    `strict` (the default): the answer must be one digit and nothing else (the prompt asks for that), so a
    right digit followed by other text scores 0. Without it, the first digit anywhere in the answer counts.
    Strictness matters for RL: with a lenient score the policy is never rewarded for ending its turn after
    the digit, and GRPO's updates soon make it ramble (the digit's reward then says nothing about the rest).
    """

    def __init__(self, format_reward: float = 0.1, strict: bool = True) -> None:
        self.format_reward = format_reward
        self.strict = strict

    def evaluate(self, task, episode) -> EvalOutput:
        text = (episode.answer or "").strip()
        answer = (text if _LONE_DIGIT.fullmatch(text) else None) if self.strict else first_digit(text)
        correct = answer == str(task["reward_model"]["ground_truth"])
        reward = 1.0 if correct else (self.format_reward if answer is not None else 0.0)
        return EvalOutput(reward=reward, is_correct=correct, metrics={"answered": float(answer is not None)})
