"""An rLLM-style config trains: step-wise advantages on a two-call agent through `AgentTrainer.train()`.

The agent's second prompt does not extend its first, so each trajectory becomes two rows (broadcast) or
two steps (per_step); the update must run on them with finite losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentrl import AgentTrainer, agent_flow, evaluator
from agentrl.data import sample_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:4]


@agent_flow
async def ask_twice(task, ctx):
    """Two calls whose second prompt drops the first answer (a rewritten history): two rows per episode."""
    question = task["prompt"][-1]["content"]
    first = await ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": question}]
    )
    second = await ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": f"Check: {question}"}]
    )
    return (first.choices[0].message.content or "") + (second.choices[0].message.content or "")


@evaluator
def longer_is_better(task, episode):
    """Any score that varies between samples, so group advantages are not all zero."""
    return float(len(episode.answer or "") % 2)


@pytest.mark.parametrize(
    "stepwise",
    [
        ["rllm.stepwise_advantage.enable=true", "rllm.stepwise_advantage.mode=broadcast"],
        ["rllm.stepwise_advantage.enable=True", "rllm.stepwise_advantage.normalize_by_steps=True"],
        ["rllm.stepwise_advantage.enable=true", "rllm.stepwise_advantage.mode=per_step"],
    ],
)
def test_an_rllm_style_stepwise_config_trains(tmp_path: Path, rows, stepwise):
    run_dir = tmp_path / "run"
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=2",
        "data.shuffle=false",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=6",
        "trainer.total_training_steps=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.val_before_train=false",
        *stepwise,
    ]
    AgentTrainer(flow=ask_twice, evaluator=longer_is_better, train_dataset=rows, config=overrides).train()
    history = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    [record] = [r for r in history if r["step"] == 1]
    assert record["batch/kept_episodes"] == 4.0
    assert record["batch/rows"] == 8.0  # two rows per episode: the second prompt does not extend the first
    assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["critic/advantages/mean"])
