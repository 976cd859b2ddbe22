"""Bad input and faults through `AgentTrainer.train()`: the run goes on, or stops early with a clear message.

A failing or hanging agent and a broken evaluator cost their rollouts, not the run; a bad dataset row is
refused before any model loads; a half-written checkpoint is never resumed from.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from agentrl import AgentTrainer, EvalOutput, MathAnswerMatch, SingleTurnChatFlow, agent_flow, evaluator
from agentrl.config import ConfigError
from agentrl.data import DatasetError, sample_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:8]


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=4",
        "data.shuffle=false",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=6",
        "trainer.total_training_steps=2",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.val_before_train=false",
        *extra,
    ]


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _position(task) -> int:
    """0..3: where the task sits in its batch of 4 (the data is not shuffled)."""
    return task["extra_info"]["index"] % 4


def test_a_flow_that_raises_or_hangs_costs_rollouts_not_the_run(tmp_path, rows):
    @agent_flow
    async def unreliable(task, ctx):
        if _position(task) == 0:
            raise ValueError(f"tool failed on {task.id}")
        if _position(task) == 1:
            await asyncio.sleep(60)
        return await SingleTurnChatFlow().run(task, ctx)

    run_dir = tmp_path / "run"
    result = AgentTrainer(
        flow=unreliable,
        evaluator=MathAnswerMatch(),
        train_dataset=rows,
        config=_overrides(run_dir, "agent.timeout=2"),
    ).train()

    assert result.global_step == 2
    steps = [r for r in _history(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["batch/termination_reason/error"] == pytest.approx(0.25)
        # The hung rollouts; on a loaded machine a slow first model call may time out too.
        assert record["batch/termination_reason/timeout"] >= 0.25
        assert record["batch/kept_episodes"] == 6.0  # the 2 error episodes of 8 are dropped, timeouts kept
        assert 0 < record["batch/rows"] <= 4.0  # the hung rollouts made no model call: no rows
        assert record["actor/grad_norm"] is not None
    assert (result.checkpoint_dir / "COMPLETE").is_file()


def test_an_evaluator_that_raises_or_returns_nan_costs_episodes_not_the_run(tmp_path, rows):
    @evaluator
    def fragile(task, episode):
        if _position(task) == 0:
            raise KeyError("grader crashed")
        if _position(task) == 1:
            return math.nan
        return EvalOutput(reward=float(len(episode.answer or "") % 2))

    run_dir = tmp_path / "run"
    result = AgentTrainer(
        flow=SingleTurnChatFlow(), evaluator=fragile, train_dataset=rows, config=_overrides(run_dir)
    ).train()

    assert result.global_step == 2
    steps = [r for r in _history(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["batch/evaluator_errors"] == 4.0  # 2 tasks x 2 samples per step
        assert record["batch/kept_episodes"] == 4.0  # scored episodes only; no invented reward
        assert record["batch/termination_reason/error"] == 0.0
        assert math.isfinite(record["actor/pg_loss"])


def test_rows_sharing_an_index_are_scored_and_grouped_as_separate_tasks(tmp_path, rows):
    """Two datasets concatenated, each indexed from 0: rows 2k and 2k+1 share `extra_info.index` = k."""
    shared = [
        {**row, "extra_info": {**row["extra_info"], "index": i // 2, "label": i % 2}}
        for i, row in enumerate(rows)
    ]

    @evaluator
    def by_label(task, episode):
        if task.data != episode.task:
            raise AssertionError(f"episode of {episode.task['prompt']} scored against {task['prompt']}")
        return float(task["extra_info"]["label"])

    run_dir = tmp_path / "run"
    AgentTrainer(
        flow=SingleTurnChatFlow(), evaluator=by_label, train_dataset=shared, config=_overrides(run_dir)
    ).train()
    for record in [r for r in _history(run_dir) if r["step"] > 0]:
        assert record["batch/evaluator_errors"] == 0.0
        # 4 tasks of 2 samples: labels 0, 1, 0, 1 -> two all-correct and two all-wrong groups (fractions of 4).
        assert (record["batch/solve_all"], record["batch/solve_none"], record["batch/solve_partial"]) == (
            0.5,
            0.5,
            0.0,
        )


def test_a_dataset_row_without_prompt_is_refused_before_any_model_loads(tmp_path, rows):
    bad = [dict(row) for row in rows]
    del bad[3]["prompt"]
    run_dir = tmp_path / "run"
    with pytest.raises(DatasetError, match=r"train_dataset: row 3: field 'prompt' is missing"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=bad,
            config=_overrides(run_dir),
        )

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in bad))
    with pytest.raises(DatasetError, match=r"train\.jsonl.*row 3.*'prompt'"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=str(path),
            config=_overrides(run_dir),
        )
    with pytest.raises(DatasetError, match=r"val_dataset: row 0: field 'prompt'"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=rows,
            val_dataset=[bad[3]],
            config=_overrides(run_dir),
        )
    assert not run_dir.exists()  # nothing was started or written


def test_a_misspelt_config_key_is_refused_before_any_model_loads(tmp_path, rows):
    with pytest.raises(ConfigError, match="total_trainig_steps"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=rows,
            config=_overrides(tmp_path / "run", "trainer.total_trainig_steps=3"),
        )
    assert not (tmp_path / "run").exists()


def test_a_half_written_checkpoint_is_skipped_and_the_run_resumes_from_the_last_complete_one(tmp_path, rows):
    run_dir = tmp_path / "run"
    first = AgentTrainer(
        flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), train_dataset=rows, config=_overrides(run_dir)
    ).train()
    assert first.checkpoint_dir == run_dir / "checkpoints" / "global_step_2"
    assert (first.checkpoint_dir / "COMPLETE").is_file()
    half = run_dir / "checkpoints" / "global_step_9"
    (half / "actor").mkdir(parents=True)
    (half / "trainer_state.json").write_text('{"global_step": 9}')  # the save died before COMPLETE

    second = AgentTrainer(
        flow=SingleTurnChatFlow(),
        evaluator=MathAnswerMatch(),
        train_dataset=rows,
        config=_overrides(run_dir, "trainer.total_training_steps=3"),
    ).train()

    assert second.global_step == 3
    assert second.checkpoint_dir == run_dir / "checkpoints" / "global_step_3"
    steps = [r["step"] for r in _history(run_dir)]
    assert steps == [1, 2, 3]  # the first run's steps, then only step 3: resumed from 2, not 9, not 0
    assert 9 not in steps
    assert _history(run_dir)[-1]["training/global_step"] == 3.0

    # Starting over in the same folder (resume disabled) begins a fresh history; the old one is kept aside.
    third = AgentTrainer(
        flow=SingleTurnChatFlow(),
        evaluator=MathAnswerMatch(),
        train_dataset=rows,
        config=_overrides(run_dir, "trainer.total_training_steps=1", "trainer.resume_mode=disable"),
    ).train()
    assert third.global_step == 1
    assert [r["step"] for r in _history(run_dir)] == [1]
    [archived] = run_dir.glob("metrics.*.jsonl")
    assert [json.loads(line)["step"] for line in archived.read_text().splitlines()] == [1, 2, 3]
