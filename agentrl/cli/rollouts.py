"""`agentrl rollouts RUN_DIR [--step N] [--episode K]`: print what the agent said in a saved episode.

A header sums up the step (episodes, mean reward, how they ended, what was filtered), then one episode
follows message by message: role, text, tool calls and their results, each model call's finish reason,
tokens, policy version and advantage. Long texts are cut at `--max-chars`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agentrl.runs.rollout_files import RolloutFilesError, find_rollouts_dir, read_rollouts, rollout_steps


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="agentrl rollouts",
        description="Print a summary of one step's saved episodes and one episode in full (docs/rollouts.md).",
    )
    parser.add_argument("run_dir", help="the run folder (trainer.default_local_dir) or its rollouts folder")
    parser.add_argument("--step", type=int, help="training step (default: the last saved one)")
    parser.add_argument(
        "--episode",
        default="0",
        help="index in the step's file (0 = first) or an episode id such as train-3:1",
    )
    parser.add_argument("--split", choices=("train", "val"), default="train", help="training or validation")
    parser.add_argument("--list", action="store_true", help="one line per episode instead of one episode")
    parser.add_argument("--max-chars", type=int, default=500, help="cut texts longer than this (0: never)")
    ns = parser.parse_args(list(argv))
    try:
        folder = find_rollouts_dir(ns.run_dir)
        records = read_rollouts(folder, ns.step, ns.split)
        step = records[0]["step"] if records else ns.step
        print(format_step_summary(records, step, ns.split, rollout_steps(folder, ns.split)))
        if ns.list:
            for index, record in enumerate(records):
                print(format_episode_line(index, record))
        elif records:
            print()
            print(format_episode(_pick(records, ns.episode), ns.max_chars))
    except RolloutFilesError as err:
        print(f"agentrl rollouts: {err}", file=sys.stderr)
        return 1
    return 0


def _pick(records: list[dict[str, Any]], which: str) -> dict[str, Any]:
    if which.lstrip("-").isdigit():
        index = int(which)
        if not -len(records) <= index < len(records):
            raise RolloutFilesError(f"--episode {index}: the step has {len(records)} saved episodes")
        return records[index]
    for record in records:
        if record["episode_id"] == which:
            return record
    raise RolloutFilesError(f"--episode {which!r}: no such episode id (e.g. {records[0]['episode_id']!r})")


def format_step_summary(records: list[dict[str, Any]], step: int, split: str, steps: list[int]) -> str:
    rewards = [r["reward"] for r in records]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    ended = Counter(r["termination_reason"] for r in records)
    filtered = Counter(r["filter_reason"] for r in records if r["filtered"])
    lines = [
        f"{split} step {step} of {steps[0]}..{steps[-1]}: {len(records)} episodes saved, mean reward {mean:.3g}",
        "  ended: " + ", ".join(f"{k} {v}" for k, v in ended.most_common()),
        "  filtered: " + (", ".join(f"{k} {v}" for k, v in filtered.most_common()) or "none"),
    ]
    return "\n".join(lines)


def format_episode_line(index: int, record: dict[str, Any]) -> str:
    answer = _cut(str(record.get("answer")), 40).replace("\n", " ")
    state = f"filtered: {record['filter_reason']}" if record["filtered"] else "kept"
    return (
        f"{index:4d}  {record['episode_id']:<24} reward {record['reward']:<6.3g} "
        f"{record['termination_reason']:<28} {state:<30} answer {answer}"
    )


def format_episode(record: dict[str, Any], max_chars: int = 500) -> str:
    """One episode as text: header, then every message and model reply of every trajectory."""
    advantage = record.get("advantage")
    state = f"filtered ({record['filter_reason']})" if record["filtered"] else "kept for training"
    lines = [
        f"episode {record['episode_id']}  task {record['task_id']}  data_source {record.get('data_source')}",
        f"reward {record['reward']:.4g}  correct {record['is_correct']}  "
        f"advantage {'-' if advantage is None else f'{advantage:+.4g}'}  "
        f"ended {record['termination_reason']}  {state}  policy v{record.get('policy_version')}",
    ]
    if record.get("error"):
        lines.append("error: " + _cut(record["error"].strip().splitlines()[-1], max_chars))
    for trajectory in record["trajectories"]:
        lines.append(f"--- trajectory {trajectory['name']} ({len(trajectory['steps'])} model calls)")
        for number, step in enumerate(trajectory["steps"], start=1):
            for message in step["messages"]:
                lines += _message_lines(message, max_chars)
            lines += _message_lines(
                {"role": "assistant", "content": step["response"], "tool_calls": step.get("tool_calls")},
                max_chars,
            )
            lines.append(f"    (call {number}: {_call_stats(step)})")
    lines.append(f"answer: {_cut(str(record.get('answer')), max_chars)}")
    return "\n".join(lines)


def _call_stats(step: dict[str, Any]) -> str:
    logprobs = step["logprobs"]
    parts = [
        f"finish {step['finish_reason']}",
        f"{len(step['prompt_ids'])} prompt + {len(step['response_ids'])} response tokens",
    ]
    if logprobs:
        parts.append(f"mean logprob {sum(logprobs) / len(logprobs):.3f}")
    parts.append(f"policy v{step.get('policy_version')}")
    if step.get("advantage") is not None:
        parts.append(f"advantage {step['advantage']:+.4g}")
    if step.get("excluded"):
        parts.append(f"not trained: {step['excluded']}")
    return ", ".join(parts)


def _message_lines(message: dict[str, Any], max_chars: int) -> list[str]:
    role = message.get("role", "?")
    if role == "tool" and message.get("tool_call_id"):
        role = f"tool {message['tool_call_id']}"
    lines = [f"[{role}] {_cut(_text(message.get('content')), max_chars)}"]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        lines.append(
            f"    -> {function.get('name')}({_cut(str(function.get('arguments')), max_chars)}) [{call.get('id')}]"
        )
    return lines


def _text(content: Any) -> str:
    """A message's content; multi-part content shows text parts and a placeholder for each image."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p.get("text", f"<{p.get('type')}>") if isinstance(p, dict) else str(p) for p in content
        )
    return json.dumps(content)


def _cut(text: str, max_chars: int) -> str:
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"
