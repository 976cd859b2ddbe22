"""A multi-turn flow whose history outgrows `data.max_prompt_length` through `AgentTrainer.train()` (issue 27).

The gateway refuses the call that passes the limit (400, code `max_prompt_length_exceeded`) before the engine
generates; the episode ends as `max_prompt_length_exceeded` with its earlier turns, and compact filtering decides:
with `mask_max_prompt_length_exceeded=false` those turns train, with the default (true) the episode is left out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentrl import AgentTrainer, agent_flow, evaluator
from agentrl.data import sample_path
from agentrl.runs.rollout_files import read_rollouts

pytestmark = pytest.mark.slow

FOLLOW_UP = "Check each digit of that sum again and explain the carry."  # ~20 tokens a turn with the reply


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:2]


@agent_flow
async def keeps_asking(task, ctx):
    """Asks again and again, the history growing each turn; the refused call's error ends the episode."""
    messages = [dict(m) for m in task["prompt"]]
    for _ in range(ctx.max_steps):
        reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": FOLLOW_UP},
        ]
    return "never refused"


@evaluator
def by_length(task, episode):
    """Any score that varies between samples, so group advantages are not all zero."""
    steps = [s for t in episode.trajectories for s in t.steps]
    return float(sum(len(s.response_ids) for s in steps) % 2)


@pytest.mark.parametrize("masked", [False, True], ids=["earlier-turns-train", "masked-by-default"])
def test_a_history_over_max_prompt_length_ends_as_such_and_compact_filtering_decides(
    tmp_path: Path, rows, masked
):
    run_dir = tmp_path / "run"
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=2",
        "data.shuffle=false",
        "data.max_prompt_length=64",
        "data.max_response_length=6",
        "agent.max_steps=10",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.val_before_train=false",
        "agent.compact_filtering.enable=true",
    ]
    if not masked:
        overrides.append("agent.compact_filtering.mask_max_prompt_length_exceeded=false")
    AgentTrainer(flow=keeps_asking, evaluator=by_length, train_dataset=rows, config=overrides).train()

    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [record] = [r for r in history if r["step"] == 1]
    assert record["batch/termination_reason/max_prompt_length_exceeded"] == 1.0
    assert record["batch/termination_reason/error"] == 0.0
    episodes = read_rollouts(run_dir, 1)
    assert len(episodes) == 4
    for episode in episodes:
        assert episode["termination_reason"] == "max_prompt_length_exceeded" and episode["error"] is None
        steps = episode["trajectories"][0]["steps"]
        assert len(steps) >= 2 and all(len(s["prompt_ids"]) <= 64 and s["response_ids"] for s in steps)
        assert episode["filter_reason"] == ("compact_filtering" if masked else None)
    if masked:
        assert record["batch/kept_episodes"] == 0.0 and "actor/pg_loss" not in record
    else:
        assert record["batch/kept_episodes"] == 4.0 and record["batch/rows"] >= 4.0
        assert math.isfinite(record["actor/pg_loss"])
