"""Scoring the tool agent: reward 1 when its final answer is the ground-truth value, else 0.

The policy cannot know what the store holds without `kv_get`, and the calculator spares it the arithmetic,
so the reward favours tool use without scoring it directly. The metrics show how the agent got there: tool calls and
failed tool calls per episode (from the flow), whether it answered at all, and whether it was right.
"""

from __future__ import annotations

import re

from agentrl import Episode, EvalOutput, Evaluator, Task
from agentrl.evaluator import normalize_number

_ANSWER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*\.?\s*")


def extract_answer(text: str | None) -> str | None:
    """The number the answer is ("851", " 851.\n" -> "851"), or None when it is anything else.

    The prompt asks for the number only. Reading the last number of any text instead rewarded answers that
    were the right digit followed by sampled garbage up to the length limit ("5 * 5 shirtsRemain ..."), and
    GRPO reinforced the garbage: on seed 3 the policy's entropy rose from 0.3 to over 3 nats a token."""
    match = _ANSWER.fullmatch(text or "")
    return match.group(1) if match else None


class ToolAnswerEvaluator(Evaluator):
    """Reward 1.0 for the right number in the final answer.

    Metrics per episode (logged as `batch/<name>` and `val/<name>`): `tool_calls`, `tool_errors`,
    `answered` (the flow ended with an answer rather than at `agent.max_steps`), `correct`.
    """

    def evaluate(self, task: Task, episode: Episode) -> EvalOutput:
        truth = (task.get("reward_model") or {}).get("ground_truth")
        if truth is None:
            raise ValueError(f"task {task.id}: row has no reward_model.ground_truth")
        predicted = extract_answer(episode.answer)
        correct = predicted is not None and normalize_number(predicted) == normalize_number(str(truth))
        return EvalOutput(
            reward=float(correct),
            is_correct=correct,
            metrics={
                "tool_calls": episode.metrics.get("tool_calls", 0.0),
                "tool_errors": episode.metrics.get("tool_errors", 0.0),
                "answered": episode.metrics.get("answered", 0.0),
                "correct": float(correct),
            },
        )
