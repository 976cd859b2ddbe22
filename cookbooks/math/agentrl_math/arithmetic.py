"""Two-digit sums in a strict one-line format: the task that trains the real SmolLM2-135M-Instruct.

The prompt asks "What is 23 + 45? Reply with one line: 23 + 45 = <number>". A reply earns reward 1 only when it
is that one line with the right number (spaces around `+` and `=` and a final period are allowed); any other
reply earns 0, including a right number buried in a longer reply. There is no reward for the format alone.

Every held-out accuracy is read twice from the same answer: strictly (the reward above) and leniently (the last
integer anywhere in the reply, which the prompt's format does not constrain), so a gain that is only the format
shows as a rise of the strict figure alone.

The problems are `agentrl.tasks.arithmetic`'s two-digit sums without carrying (1,980 distinct): 1,000 for training
and 200 held out, none of them in both. Only the instruction differs from `make train`'s rows: the untuned model
answers the bare "Answer with the number only." with an equation nearly every time, so it would start at 0%.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl import Episode, EvalOutput, Evaluator, Task
from agentrl.tasks.arithmetic import make_rows

DATA_SOURCE = "arithmetic_equation"
INSTRUCTION = "Reply with one line: {expression} = <number>"
"""Appended to "What is {expression}?"; the strict reading accepts exactly this line with the right number."""

_INTEGER = re.compile(r"-?\d+")
_SUM = re.compile(r"(\d+) \+ (\d+)")


def make_sum_rows(
    num_train: int = 1000, num_test: int = 200, *, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of distinct sums, none in both (`agentrl.tasks.arithmetic.make_rows`), with
    this task's prompt and data source."""
    train, test = make_rows(num_train, num_test, seed=seed)
    return [_with_instruction(row) for row in train], [_with_instruction(row) for row in test]


def _with_instruction(row: dict[str, Any]) -> dict[str, Any]:
    expression = row["extra_info"]["expression"]
    content = f"What is {expression}? {INSTRUCTION.format(expression=expression)}"
    reply = f"{expression} = {row['reward_model']['ground_truth']}"  # what a warm start (sft) would teach
    return {
        **row,
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "extra_info": {**row["extra_info"], "response": reply},
    }


def strict_answer(text: str | None, expression: str) -> str | None:
    """The number of a reply that is exactly the one line "<expression> = <number>" (optional final period,
    any spacing around `+` and `=`), else None."""
    operands = _SUM.fullmatch(expression)
    if operands is None:
        raise ValueError(f"expected an expression 'a + b', got {expression!r}")
    a, b = operands.groups()
    found = re.fullmatch(rf"{a}\s*\+\s*{b}\s*=\s*(-?\d+)\s*\.?", (text or "").strip())
    return found.group(1) if found else None


def lenient_answer(text: str | None) -> str | None:
    """The last integer anywhere in the reply, whatever surrounds it, else None."""
    numbers = _INTEGER.findall(text or "")
    return numbers[-1] if numbers else None


def grade(text: str | None, row: dict[str, Any]) -> tuple[bool, bool]:
    """(strictly right, leniently right) for one reply to one row."""
    truth = str(row["reward_model"]["ground_truth"])
    strict = strict_answer(text, row["extra_info"]["expression"]) == truth
    return strict, lenient_answer(text) == truth


class SumEvaluator(Evaluator):
    """Reward 1.0 for the one-line equation with the right sum, else 0 (the strict reading).

    Metrics per episode: `lenient_correct` (the last integer of the reply is the sum) and `format` (the reply is
    the one-line equation, right or wrong; reported, never rewarded).
    """

    def evaluate(self, task: Task, episode: Episode) -> EvalOutput:
        strict, lenient = grade(episode.answer, task.data)
        formatted = strict_answer(episode.answer, task["extra_info"]["expression"]) is not None
        return EvalOutput(
            reward=float(strict),
            is_correct=strict,
            metrics={"lenient_correct": float(lenient), "format": float(formatted)},
        )
