"""Asynchronous training on CPU: rollouts of the next steps run while a step trains, within the staleness bound."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path

import pytest

from agentrl import AgentTrainer, agent_flow, evaluator
from agentrl.data import sample_path
from agentrl.runs.rollout_files import read_rollouts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:16]


@agent_flow
async def two_turns_with_a_slow_tool(task, ctx):
    """Two model calls with a tool wait between them, the second re-sending the history."""
    messages = list(task["prompt"])
    reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    await asyncio.sleep(0.05)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    second = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    return second.choices[0].message.content or ""


@evaluator
def odd_length(task, episode):
    """A score that varies between samples, so group advantages are not all zero."""
    return float(len(episode.answer or "") % 2)


def _versions(run_dir: Path, step_number: int) -> list[int]:
    """The policy version of every model call in the saved rollouts of one training step."""
    return [
        step["policy_version"]
        for record in read_rollouts(run_dir, step=step_number)
        for trajectory in record["trajectories"]
        for step in trajectory["steps"]
    ]


def _train(run_dir: Path, rows, *extra: str, flow=two_turns_with_a_slow_tool) -> list[dict]:
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=2",
        "data.shuffle=false",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=6",
        "trainer.total_training_steps=4",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.val_before_train=false",
        *extra,
    ]
    random.seed(0)
    AgentTrainer(flow=flow, evaluator=odd_length, train_dataset=rows, config=overrides).train()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "timing/step" in r]


@pytest.mark.parametrize("partial_rollout", [True, False])
def test_rollouts_run_ahead_by_at_most_the_staleness_threshold(tmp_path: Path, rows, partial_rollout, caplog):
    history = _train(
        tmp_path / "run",
        rows,
        "async_training.enable=true",
        "async_training.staleness_threshold=1",
        f"async_training.partial_rollout={str(partial_rollout).lower()}",
    )
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in history)
    assert max(r["async/staleness_max"] for r in history) == 1.0  # batches really were collected a step ahead
    assert all(r["async/staleness_max"] <= 1.0 for r in history)
    # Each step says how long its batch took to collect and how much of that ran before the step waited for it.
    assert all(
        0 < r["async/batch_collect_s"] <= r["async/batch_head_start_s"] + r["timing/gen"] + 0.05
        for r in history
    )
    assert (
        max(r["async/batch_head_start_s"] for r in history[1:]) > 0
    )  # later batches started ahead of their step
    # Every second turn continued its session; turns made while an earlier step trained count too.
    merged = sum(r["batch/merged_steps"] for r in history)
    assert merged == 16
    assert sum(r["gateway/continued_turns"] for r in history) >= merged
    versions = [v for step_number in (2, 3, 4) for v in _versions(tmp_path / "run", step_number)]
    assert versions and all(isinstance(v, int) for v in versions)
    assert "set algorithm.rollout_correction.bypass_mode=true" in caplog.text  # nothing bounds the lag: said
    assert "holds less than two batches" not in caplog.text  # 64 places for batches of 4 episodes
    if not partial_rollout:  # weights change only between batches: one version per step's episodes
        for step_number in (2, 3, 4):
            seen = set(_versions(tmp_path / "run", step_number))
            assert len(seen) == 1, seen


def test_rollouts_run_ahead_with_the_engine_in_a_ray_worker(tmp_path: Path, rows):
    """`trainer.backend=ray`: the flows and the gateway stay in the driver while the engine and the trainer live in
    a worker actor; the worker trains a step while its engine serves the next batch's calls over HTTP, and the
    weights it pushes after each update reach the engine (the fingerprint check of every push passes)."""
    history = _train(
        tmp_path / "run",
        rows,
        "trainer.backend=ray",
        "trainer.n_gpus_per_node=1",
        "async_training.enable=true",
        "async_training.staleness_threshold=1",
        "algorithm.rollout_correction.bypass_mode=true",
        "trainer.total_training_steps=3",
    )
    assert [r["step"] for r in history] == [1, 2, 3]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in history)
    assert max(r["async/staleness_max"] for r in history) == 1.0
    assert sum(r["batch/merged_steps"] for r in history) == 12  # every second turn continued its session
    # Step k trains policy version k (the first push is version 1): its calls were served by version k or k-1.
    for step_number in (1, 2, 3):
        versions = set(_versions(tmp_path / "run", step_number))
        assert versions and versions <= {step_number - 1, step_number}, (step_number, versions)


def test_staleness_zero_is_the_synchronous_loop(tmp_path: Path, rows):
    sync = _train(tmp_path / "sync", rows)
    zero = _train(
        tmp_path / "zero", rows, "async_training.enable=true", "async_training.staleness_threshold=0"
    )
    for a, b in zip(sync, zero, strict=True):
        assert a["actor/pg_loss"] == b["actor/pg_loss"] and a["actor/grad_norm"] == b["actor/grad_norm"]
        assert a["async/staleness_max"] == b["async/staleness_max"] == 0.0


def test_stale_batches_train_with_truncated_importance_weights(tmp_path: Path, rows):
    history = _train(
        tmp_path / "run",
        rows,
        "async_training.enable=true",
        "async_training.staleness_threshold=1",
        "algorithm.rollout_correction.tis_mode=token",
        "algorithm.rollout_correction.tis_cap=2.0",
    )
    assert max(r["async/staleness_max"] for r in history) == 1.0
    for record in history:
        assert 0.0 < record["rollout_corr/is_weight_mean"] <= record["rollout_corr/is_weight_max"] <= 2.0
        assert math.isfinite(record["rollout_corr/kl_k3"]) and math.isfinite(record["actor/pg_loss"])
    # Weights changed between the engine's sampling and the update: the stale tokens' ratios are not all 1.
    assert max(abs(r["rollout_corr/log_ratio_mean"]) for r in history) > 1e-6


def test_bypass_mode_clips_stale_batches_against_the_engines_log_probs(tmp_path: Path, rows, caplog):
    """With bypass_mode the old policy is the engine's: on a stale batch the ratio pi_theta / pi_rollout at the
    start of the update is not 1 (the weights moved since sampling), and the lag is measured every step."""
    history = _train(
        tmp_path / "run",
        rows,
        "async_training.enable=true",
        "async_training.staleness_threshold=1",
        "algorithm.rollout_correction.bypass_mode=true",
        "agent.n_parallel_tasks=6",
    )
    assert max(r["async/staleness_max"] for r in history) == 1.0
    stale = [r for r in history if r["async/staleness_max"] > 0]
    assert stale and max(abs(r["actor/ppo_ratio_mean"] - 1.0) for r in stale) > 1e-4
    assert all(math.isfinite(r["rollout_corr/kl_k3"]) for r in history)
    assert "bypass_mode=true" not in caplog.text
    # Six places for batches of four episodes: the next batch cannot run beside the last one whole. Said.
    assert (
        "agent.n_parallel_tasks=6 (by default the engines' max_num_seqs) holds less than two" in caplog.text
    )


_slow_prompts: set[str] = set()
"""The prompts of the tasks `every_second_task_slow` waits on (the second of each batch: set by the test)."""


@agent_flow
async def every_second_task_slow(task, ctx):
    """One model call, then a tool that takes 1 s for the second task of every batch (`_slow_prompts`): each batch
    has a group that finishes early and one that finishes late. Chosen by task, not by the order of the calls: the
    replies of a batch come back in any order, and a run ahead starts the next batch's calls, so a counter of calls
    once slowed one episode of each group and no group finished early."""
    reply = await ctx.client.chat.completions.create(model=ctx.model, messages=list(task["prompt"]))
    await asyncio.sleep(1.0 if task["prompt"][-1]["content"] in _slow_prompts else 0.02)
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("ranks", [0, 2], ids=["local", "ray-2-ranks"])
def test_a_streamed_update_trains_the_groups_that_finished_while_the_rest_run(tmp_path: Path, rows, ranks):
    """`async_training.streaming_update`: the early group of every batch goes into the update while the late one
    still waits on its tool; the step's one optimizer step follows the late group. On two FSDP ranks every chunk
    is split between them, each with as many micro-batches, and the gradients divided by both ranks' total."""
    backend = ["trainer.backend=ray", f"trainer.n_gpus_per_node={ranks}"] if ranks else []
    _slow_prompts.clear()
    _slow_prompts.update(row["prompt"][-1]["content"] for row in rows[1::2])  # batches of 2 tasks, in order
    history = _train(
        tmp_path / "run",
        rows,
        *backend,
        # A group's two rows make a chunk: a micro-batch on one rank, one row each on two.
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={2 // max(ranks, 1)}",
        "async_training.enable=true",
        "async_training.staleness_threshold=1",
        "async_training.streaming_update=true",
        "algorithm.rollout_correction.bypass_mode=true",
        flow=every_second_task_slow,
    )
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]) for r in history)
    # Every step with a nonzero advantage got a gradient; one whose two groups each tie in reward has none.
    moved = [max(r["critic/advantages/max"], -r["critic/advantages/min"]) > 0 for r in history]
    assert any(moved) and all((r["actor/grad_norm"] > 0) == m for r, m in zip(history, moved, strict=True))
    assert all(r["batch/rows"] == 4 and r["async/staleness_max"] <= 1.0 for r in history)
    # The first batch's early group trained while its late group waited on its tool (1 s): half its rows.
    # Later batches start a step ahead, so both of a batch's groups may be done when its step begins (0).
    shares = [r["async/streamed_share"] for r in history]
    assert shares[0] == 0.5 and set(shares) <= {0.0, 0.5}, shares
    assert all(0 < r["timing/stream_actor"] < r["timing/gen"] for r in history)
