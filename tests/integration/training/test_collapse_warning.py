"""A policy that samples almost uniformly is named, every step, instead of training on noise in silence.

A `tiny:` preset with random weights is such a policy: its token entropy is ~ln(vocabulary). The threshold, and
that a peaked policy stays quiet: tests/unit/training/test_metrics.py.
"""

import json
import logging

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.data import sample_path

pytestmark = pytest.mark.slow


def _run(tmp_path) -> dict:
    with open(sample_path("arithmetic_train")) as f:
        rows = [json.loads(line) for line in f][:4]
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=8",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    ]
    trainer = AgentTrainer(
        flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), config=overrides, train_dataset=rows
    )
    return trainer.train().metrics


def test_a_policy_with_random_weights_is_named_as_sampling_at_random(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agentrl.training.controller"):
        metrics = _run(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if "samples almost at random" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 1: actor/entropy "), warnings
    assert metrics["actor/entropy"] > 0.9 * 7.6  # ln(2,048): the warning's own reading
