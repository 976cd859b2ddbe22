"""A real training run scores its episodes with the setup heap frozen, and leaves it unfrozen."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from _short_run import short_run_overrides

from agentrl import AgentTrainer, EvalOutput, SingleTurnChatFlow, evaluator
from agentrl.config import load_config

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def test_the_loop_runs_with_the_setup_heap_frozen(tmp_path):
    frozen_while_scoring: list[int] = []

    @evaluator
    def score(task, episode):
        frozen_while_scoring.append(gc.get_freeze_count())
        return EvalOutput(reward=float(len(episode.answer or "") % 2))

    overrides = short_run_overrides(tmp_path, "actor_rollout_ref.model.path=tiny:qwen2")
    config = load_config(overrides, config_path=REPO / "configs" / "arithmetic.yaml")
    AgentTrainer(flow=SingleTurnChatFlow(), evaluator=score, config=config).train()
    assert len(frozen_while_scoring) == 16 and min(frozen_while_scoring) > 10_000  # the models' objects
    assert gc.get_freeze_count() == 0
