"""Single-digit arithmetic ("What is 7 + 5?", "What is 9 - 4?"): the task behind `make train`.

A tiny model on two CPU cores can learn it in minutes: after a short supervised warm start it answers some
problems, and GRPO raises held-out accuracy from there. The 155 distinct problems are split into 115 for
training and 40 held out (no held-out expression is trained on). Rows are in the verl format, so the same pipeline
that trains GSM8K trains this.

    python -m agentrl.tasks.arithmetic --output agentrl/data/samples
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "arithmetic"
INSTRUCTION = "Answer with the number only."


def make_problem(rng: random.Random, max_operand: int) -> tuple[str, int]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    a, b = max(a, b), min(a, b)
    return f"{a} - {b}", a - b


def make_rows(
    num_train: int, num_test: int, *, seed: int = 0, max_operand: int = 30
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and held-out rows; no held-out expression appears in the training rows."""
    distinct = (max_operand + 1) ** 2 + (max_operand + 1) * (max_operand + 2) // 2
    if num_train + num_test > distinct:
        raise ValueError(
            f"only {distinct} distinct problems with max_operand={max_operand}; "
            f"asked for {num_train} + {num_test}"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[tuple[str, int]] = []
    while len(problems) < num_train + num_test:
        expression, answer = make_problem(rng, max_operand)
        if expression not in seen:
            seen.add(expression)
            problems.append((expression, answer))
    rows = [_row(i, expression, answer) for i, (expression, answer) in enumerate(problems)]
    return rows[num_test:], rows[:num_test]


def _row(index: int, expression: str, answer: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}],
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "response": str(answer), "expression": expression},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output", required=True, help="folder for arithmetic_train.jsonl / arithmetic_test.jsonl"
    )
    parser.add_argument("--num-train", type=int, default=115)
    parser.add_argument("--num-test", type=int, default=40)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = make_rows(args.num_train, args.num_test, seed=args.seed, max_operand=args.max_operand)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("arithmetic_train", train), ("arithmetic_test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"wrote {len(rows)} rows to {out / name}.jsonl")


if __name__ == "__main__":
    main()
