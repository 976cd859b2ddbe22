"""Episodes as MLflow traces in a real SQLite store: a span per model call and per tool call, searchable tags,
the process's tracking URI given back, and a failure that warns once without stopping anything."""

from __future__ import annotations

import logging
import os

import mlflow
import pytest
from mlflow.entities import SpanType

from agentrl.runs.rollout_writer import episode_record
from agentrl.tracking import build_tracker
from agentrl.tracking.mlflow_traces import use_tracking_uri
from tests.unit.training.test_rollout_log import _tool_episode


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _tracker(run_dir):
    return build_tracker(
        ["mlflow"], run_dir=run_dir, project_name="proj", experiment_name="exp", config={"a": 1}, resume=False
    )


def test_an_episode_becomes_a_trace_with_model_and_tool_spans(tmp_path):
    before = mlflow.get_tracking_uri()
    tracker = _tracker(tmp_path)
    record = episode_record(_tool_episode(), step=4, split="train", config_digest="abc")
    tracker.log_rollouts([record], step=4)
    tracker.finish()
    assert mlflow.get_tracking_uri() == before and "MLFLOW_TRACKING_URI" not in os.environ

    with use_tracking_uri(tracker.backends["mlflow"].tracking_uri):
        (trace,) = mlflow.search_traces(
            locations=[tracker.backends["mlflow"].experiment_id],
            run_id=tracker.mlflow_run_id,
            filter_string="tags.`agentrl.step` = '4'",
            return_type="list",
        )
    assert mlflow.get_tracking_uri() == before and "MLFLOW_TRACKING_URI" not in os.environ
    tags = trace.info.tags
    assert tags["agentrl.episode_id"] == "train-7:1" and tags["agentrl.filtered"] == "false"
    assert tags["agentrl.reward"] == "1.0" and tags["agentrl.termination_reason"] == "env_done"
    spans = {s.name: s for s in trace.data.spans}
    assert spans["episode train-7:1"].outputs["answer"] == "5"
    first, second, tool = spans["solver call 1"], spans["solver call 2"], spans["add"]
    assert first.span_type == second.span_type == SpanType.CHAT_MODEL and tool.span_type == SpanType.TOOL
    assert first.outputs["choices"][0]["message"]["tool_calls"][0]["id"] == "call_1"
    # The second call's input is the whole conversation again, rebuilt from the saved new messages.
    assert [m["role"] for m in second.inputs["messages"]] == ["system", "user", "assistant", "tool"]
    assert tool.inputs["arguments"] == {"a": 2, "b": 3} and tool.outputs == {"content": "5"}
    assert first.start_time_ns < tool.start_time_ns < second.start_time_ns
    assert first.attributes["completion_tokens"] == 2 and first.attributes["policy_version"] == 3


def test_a_tracing_failure_warns_once_and_training_goes_on(tmp_path, caplog):
    tracker = _tracker(tmp_path)
    broken = {"episode_id": "x"}  # not a record: building its trace fails
    with caplog.at_level(logging.WARNING, logger="agentrl.tracking.mlflow_backend"):
        tracker.log_rollouts([broken], step=1)
        tracker.log_rollouts([broken], step=2)
        tracker.log({"reward": 1.0}, step=2)  # metrics still go through
        tracker.finish()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not log step" in m for m in messages) == 1
    assert any("2 attempts to log episodes as traces failed" in m for m in messages)
