"""Validation runs every held-out task, `data.val_batch_size` at a time, with the validation sampling."""

import json

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.data import sample_path

pytestmark = pytest.mark.slow


def _rows(name: str, count: int) -> list[dict]:
    with open(sample_path(name)) as f:
        return [json.loads(line) for line in f][:count]


def test_validation_covers_every_task_in_batches(tmp_path):
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=4",
        "trainer.total_training_steps=1",
        "trainer.test_freq=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "data.val_batch_size=2",
    ]
    result = AgentTrainer(
        flow=SingleTurnChatFlow(),
        evaluator=MathAnswerMatch(),
        config=overrides,
        train_dataset=_rows("arithmetic_train", 8),
        val_dataset=_rows("arithmetic_test", 5),
    ).train()
    assert result.initial_val_metrics["val/num_episodes"] == 5  # 2 + 2 + 1
    assert result.metrics["val/num_episodes"] == 5
    assert set(result.metrics) >= {"val/accuracy", "val/test_score/arithmetic", "val/has_answer"}
