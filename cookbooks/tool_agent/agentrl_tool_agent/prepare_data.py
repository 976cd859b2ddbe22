"""Generate the tool agent's data offline: tasks for RL and per-turn rows for the warm start.

    python -m agentrl_tool_agent.prepare_data --output data/tool_agent
    # wrote 180 rows to data/tool_agent/train.jsonl, 200 to test.jsonl, 360 to sft.jsonl

Two kinds of task, each needing one tool call: `calc` ("What is 7 * 3?": the calculator) and `kv`
("What is stored under 'plum'?": `kv_get` on the episode's store, which the row seeds through
`extra_info.store` and the policy never sees). No held-out question appears in the training rows. There are
192 `calc` questions (operands 2-9, `+ - *`) and half the rows are calc, so train and held-out rows together
hold at most 384 tasks; the defaults (180 train, 200 held-out) use 190 of the questions.

`sft.jsonl` holds two rows per training task, one per turn of the ideal episode, in verl row format with
the `tools` schema: the first turn's target is the tool call, the second's (after the `tool` message with
the result) the answer. `train.py` warm-starts on them so the policy knows the call format before GRPO.
`agentrl_tool_agent/samples/` ships train.jsonl and test.jsonl as this script writes them with the defaults
(train.py builds the sft rows itself).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from agentrl_tool_agent.tools import TOOL_SCHEMAS, calculate

INSTRUCTION = "Answer with the number only."
KEYS = "apple pear plum kiwi lime fig grape melon".split()
CALC_QUESTIONS = 8 * 8 * 3
"""Distinct `calc` questions: two operands in 2-9, one of `+ - *`."""
SAMPLES = Path(__file__).resolve().parent / "samples"
"""Where the shipped data lies (train.jsonl, test.jsonl, sft.jsonl)."""


def make_task(rng: random.Random, kind: str) -> tuple[str, dict[str, Any]]:
    """(question, extra_info) of one task: its tool call, the call's result and, for kv, the store."""
    if kind == "calc":
        a, b, op = rng.randint(2, 9), rng.randint(2, 9), rng.choice("+-*")
        expression = f"{a} {op} {b}"
        return f"What is {expression}?", {
            "kind": kind,
            "call": {"name": "calculator", "arguments": {"expression": expression}},
            "result": calculate(expression),
        }
    keys = rng.sample(KEYS, 3)
    store = {k: str(rng.randint(1, 9)) for k in keys}
    key = rng.choice(keys)
    return f"What is stored under '{key}'?", {
        "kind": kind,
        "store": store,
        "call": {"name": "kv_get", "arguments": {"key": key}},
        "result": store[key],
    }


def make_rows(num_train: int, num_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and held-out task rows, half calc and half kv, with no question in both (held-out rows first)."""
    calc = (num_train + num_test + 1) // 2
    if calc > CALC_QUESTIONS:
        raise ValueError(
            f"{num_train} train + {num_test} held-out tasks need {calc} distinct calc questions, but there are "
            f"{CALC_QUESTIONS}; ask for at most {2 * CALC_QUESTIONS} tasks in all"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    while len(rows) < num_train + num_test:
        kind = ("calc", "kv")[len(rows) % 2]
        question, info = make_task(rng, kind)
        if question in seen and kind == "calc":
            continue  # kv questions repeat by key but differ by store, so only calc ones must be unique
        seen.add(question)
        rows.append(
            {
                "data_source": f"tool_agent/{kind}",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "reward_model": {"style": "rule", "ground_truth": info["result"]},
                "extra_info": {"index": len(rows), **info},
            }
        )
    return rows[num_test:], rows[:num_test]


def sft_rows(task_rows: list[dict[str, Any]], with_tools: bool = True) -> list[dict[str, Any]]:
    """Two warm-start rows per task: (question -> tool call) and (question, call, result -> answer).

    `with_tools=False` leaves out the `tools` schemas, so the prompt has no ~300-token tool preamble: the same
    targets at a seventh of the tokens, which makes a cheap first warm-start stage (see train.py).
    """
    out = []
    for number, row in enumerate(task_rows):
        info = row.get("extra_info") or {}
        if "call" not in info or "result" not in info:
            raise ValueError(f"row {number}: extra_info needs `call` and `result` to build warm-start rows")
        call = info["call"]
        call_text = (
            f'<tool_call>\n{{"name": "{call["name"]}", "arguments": '
            f"{json.dumps(call['arguments'], sort_keys=True)}}}\n</tool_call>"
        )
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ],
        }
        tool = {"role": "tool", "tool_call_id": "call_0", "content": info["result"]}
        for turn, (prompt, response) in enumerate(
            [(row["prompt"], call_text), ([*row["prompt"], assistant, tool], info["result"])]
        ):
            sft_row = {**row, "prompt": prompt, "extra_info": {**info, "turn": turn, "response": response}}
            if with_tools:
                sft_row["tools"] = TOOL_SCHEMAS
            out.append(sft_row)
    return out


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentrl_tool_agent.prepare_data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--output", default="data/tool_agent", help="folder for train/test/sft.jsonl")
    parser.add_argument("--num-train", type=int, default=180)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_train < 1 or args.num_test < 1:
        print("error: --num-train and --num-test must be at least 1", file=sys.stderr)
        return 1
    try:
        train, test = make_rows(args.num_train, args.num_test, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.output)
    for name, rows in (("train", train), ("test", test), ("sft", sft_rows(train))):
        write_jsonl(rows, out / f"{name}.jsonl")
        print(f"wrote {len(rows)} rows to {out / name}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
