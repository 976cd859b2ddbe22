"""Full garbage collections skip what setup built while a run trains (`agentrl.training.gc_pauses`), garbage
made later is still collected, and a finished run thaws what it froze."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.data import sample_path
from agentrl.training.gc_pauses import freeze_setup_objects, thaw_setup_objects


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_collects_setup_garbage_first_and_later_cycles_still_go():
    try:
        left_over = _Cycle()
        gone_before = weakref.ref(left_over)
        kept = _Cycle()
        del left_over
        assert freeze_setup_objects() > 0
        assert gone_before() is None  # collected, not frozen
        assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it
        later = _Cycle()
        gone_later = weakref.ref(later)
        del later
        gc.collect()
        assert gone_later() is None
    finally:
        thaw_setup_objects()
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())


class _RecordingFlow(SingleTurnChatFlow):
    """Notes the frozen object count whenever a task's group runs (after setup)."""

    frozen: list[int] = []

    async def run_group(self, task, ctx, n):
        _RecordingFlow.frozen.append(gc.get_freeze_count())
        return await super().run_group(task, ctx, n)


@pytest.mark.slow
def test_a_run_trains_with_its_setup_frozen_and_thaws_at_the_end(tmp_path):
    with open(sample_path("arithmetic_train")) as f:
        rows = [json.loads(line) for line in f][:4]
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=4",
        "trainer.total_training_steps=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    ]
    _RecordingFlow.frozen = []
    AgentTrainer(
        flow=_RecordingFlow(), evaluator=MathAnswerMatch(), config=overrides, train_dataset=rows
    ).train()
    assert len(_RecordingFlow.frozen) == 4 and min(_RecordingFlow.frozen) > 100_000  # the process's setup
    assert gc.get_freeze_count() == 0
