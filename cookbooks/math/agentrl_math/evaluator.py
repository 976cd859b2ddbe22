"""GSM8K scoring: reward 1 when the number after `####` equals the ground truth, numerically.

Only an answer after `####` counts (GSM8K's own format, which the prompt asks for), so the policy is
rewarded for answering in the format rather than for a number that happens to end its reasoning. A small
format reward for giving any `####` number can be switched on to help a model that never uses the format.
"""

from __future__ import annotations

import re

from agentrl import Episode, EvalOutput, Evaluator, Task
from agentrl.evaluator import extract_final_answer, normalize_number

_LEADING_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_gsm8k_answer(text: str | None) -> str | None:
    """The number that follows the last `####` ("#### $1,234 dollars" -> "1,234"), or None.

    None when there is no `####` or no number right after it: a reply without the final-answer mark
    does not get credit for the last number in its reasoning.
    """
    if not text or "####" not in text:
        return None
    answer = (extract_final_answer(text) or "").replace("$", "").strip()
    match = _LEADING_NUMBER.match(answer)
    return match.group(0) if match else None


class GSM8KEvaluator(Evaluator):
    """Reward 1.0 for the right number after `####`; `format_reward` (default 0) for a wrong one.

    Metrics per episode: `has_answer` (a number after `####` was given) and `correct`.
    """

    def __init__(self, format_reward: float = 0.0) -> None:
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        self.format_reward = format_reward

    def evaluate(self, task: Task, episode: Episode) -> EvalOutput:
        truth = (task.get("reward_model") or {}).get("ground_truth")
        if truth is None:
            raise ValueError(f"task {task.id}: row has no reward_model.ground_truth")
        predicted = extract_gsm8k_answer(episode.answer)
        correct = predicted is not None and normalize_number(predicted) == normalize_number(str(truth))
        has_answer = predicted is not None
        reward = 1.0 if correct else (self.format_reward if has_answer else 0.0)
        return EvalOutput(
            reward=reward,
            is_correct=correct,
            metrics={"has_answer": float(has_answer), "correct": float(correct)},
        )
