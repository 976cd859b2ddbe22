"""benchmarks/agent_step.py runs its multi-turn workload through the real trainer and reports a row per config."""

from __future__ import annotations

import json

import pytest

from benchmarks import agent_step


def test_config_specs_split_at_keys_only():
    assert agent_step.split_config("base:") == ("base", [])
    assert agent_step.split_config("x:a.b=1,trainer.logger=[console,mlflow],c=d") == (
        "x",
        ["a.b=1", "trainer.logger=[console,mlflow]", "c=d"],
    )


def test_a_missing_metric_prints_as_n_a():
    row = {"config": "x", "step_s": 1.5, "rows": 12.0, "prefix_cache_hit_rate": None}
    line = agent_step.table_lines([row])[-1]
    assert line.startswith("| x | 1.50 |") and "| 12 |" in line and "n/a" in line


def test_each_row_carries_its_episodes_per_second_over_the_first_configs():
    first = agent_step.with_ratio({"config": "sync", "episodes_per_s": 10.0}, None)
    faster = agent_step.with_ratio({"config": "staleness1", "episodes_per_s": 16.5}, first)
    assert first["episodes_vs_first"] == 1.0 and faster["episodes_vs_first"] == 1.65
    assert "| staleness1 | n/a | n/a | 16.5 | 1.65 |" in agent_step.table_lines([first, faster])[-1]


@pytest.mark.slow
def test_a_tiny_run_reports_a_row_that_a_later_failing_config_keeps(tmp_path, capsys):
    """One config runs, the next fails at its config check: the first one's row was printed and written when it
    ended, so a run cut short (a failure, a device call's time limit) loses only the config it was in."""
    out = tmp_path / "agent_step.json"
    with pytest.raises(SystemExit, match="config broken failed"):
        agent_step.main(
            ["--model", "tiny:qwen2-mini", "--device", "cpu", "--tasks", "1", "--episodes", "2"]
            + ["--turns", "2", "--steps", "2", "--system-tokens", "20", "--min-answer", "2"]
            + ["--max-answer", "4", "--obs-tokens", "8", "--out", str(out)]
            # Spare engine slots: with exactly one slot per episode, the embedded engine can find none free for
            # a next turn that only partly extends its parked slot (seen with prefix caching, 2026-11-25).
            + ["--set", "actor_rollout_ref.rollout.max_num_seqs=8"]
            + ["--config", "default:", "--config", "broken:data.train_batch_size=0"]
        )
    [row] = json.loads(out.read_text())["rows"]
    assert (
        row["step_s"] > 0
        and row["mean_step_s"] > 0
        and row["episodes_per_s"] > 0
        and row["gen_s"] > 0
        and row["update_s"] > 0
    )
    assert row["rows"] > 0 and row["failed_share"] == 0
    assert 0 < row["tool_wait_share"] < 1  # one longtail tool call per episode, between the two model calls
    assert row["last_prompt_tokens"] > row["system_tokens"]
    assert len(row["all_step_s"]) == 2 and row["steps_measured"] == 1 and row["episodes_vs_first"] == 1.0
    assert row["phases"]["timing/update_actor"] == row["update_s"] and "timing/sync_weights" in row["phases"]
    printed = capsys.readouterr().out
    assert "default done: | default | " in printed


@pytest.mark.slow
def test_streamed_calls_merge_and_report_the_tokens_a_chunk_carried():
    """`--stream`: every call streams through the gateway and still continues in token space (every next turn
    merges into its episode's row); one decode step per engine step streams a token a chunk, four per engine
    step more than one (an engine step's tokens come as one chunk); the first tokens come before the last."""
    rows = agent_step.main(
        ["--model", "tiny:qwen2-mini", "--device", "cpu", "--tasks", "1", "--episodes", "2", "--turns", "3"]
        + ["--steps", "2", "--system-tokens", "20", "--min-answer", "12", "--max-answer", "16"]
        + ["--obs-tokens", "8", "--tool-latency", "zero", "--stream"]
        + ["--set", "actor_rollout_ref.rollout.max_num_seqs=8"]
        + ["--config", "k1:", "--config", "k4:actor_rollout_ref.rollout.num_scheduler_steps=4"]
    )
    one, four = rows
    assert one["merged_steps"] == four["merged_steps"] == 4  # 2 episodes x 2 next turns
    assert one["continuation_fallbacks"] == four["continuation_fallbacks"] == 0
    assert one["tokens_per_chunk"] == 1 and four["tokens_per_chunk"] > 1.5
    # The flows call the trainer's gateway in-process: their chunks come as generated, not all at the end (a
    # token a chunk: 0.45-0.49 of a call's time until the first on a quiet host, 0.965-0.967 through httpx's
    # ASGITransport, which runs the app to its end first).
    assert one["first_token_share"] < 0.85
