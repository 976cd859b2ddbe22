"""`agent.n_parallel_tasks` left unset runs as many episodes at once as the rollout engine decodes
(`rollout.max_num_seqs`), so a step's episodes share one engine batch instead of queueing in waves of a fixed
size; set, it is the limit."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.data import sample_path

pytestmark = pytest.mark.slow


class ConcurrencyProbe(SingleTurnChatFlow):
    """Holds each episode open briefly before its model call and records the most episodes open at once."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0
        self.peak = 0

    async def run(self, task, ctx):
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            await asyncio.sleep(0.2)
            return await super().run(task, ctx)
        finally:
            self.open -= 1


def _peak_episodes(tmp_path, *extra: str, steps: int = 1) -> int:
    with open(sample_path("arithmetic_train")) as f:
        rows = [json.loads(line) for line in f][:4]
    flow = ConcurrencyProbe()
    AgentTrainer(
        flow=flow,
        evaluator=MathAnswerMatch(),
        train_dataset=rows,
        config=[
            "actor_rollout_ref.model.path=tiny:qwen2-mini",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "data.max_response_length=4",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            f"trainer.total_training_steps={steps}",
            *extra,
        ],
    ).train()
    return flow.peak


def test_unset_n_parallel_tasks_follows_the_engines_batch(tmp_path):
    assert _peak_episodes(tmp_path / "auto", "actor_rollout_ref.rollout.max_num_seqs=6") == 6
    assert (
        _peak_episodes(
            tmp_path / "set", "actor_rollout_ref.rollout.max_num_seqs=6", "agent.n_parallel_tasks=3"
        )
        == 3
    )


def test_batches_collected_at_once_share_the_limit(tmp_path):
    """Asynchronous training collects several steps' batches at once (staleness 2: three at the first step); their
    episodes together never pass the limit, so the engine is never asked for more sequences than it holds."""
    peak = _peak_episodes(
        tmp_path,
        "actor_rollout_ref.rollout.max_num_seqs=6",
        "async_training.enable=true",
        "async_training.staleness_threshold=2",
        "algorithm.rollout_correction.bypass_mode=true",
        steps=3,
    )
    assert peak == 6
