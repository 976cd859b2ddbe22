"""Saved episodes as MLflow traces: one trace per episode, a span per model call and per tool call.

`mlflow ui` then shows each episode as a conversation, and `mlflow.search_traces` finds them by the
`agentrl.*` tags (step, split, task, reward, termination reason, filtered). The records are those of
`agentrl.runs.rollout_writer`, so a trace shows exactly what the step's JSONL file holds (token ids left out).

MLflow's tracing API exports to the process-wide tracking URI, in background threads. The writer points it
at the run's store on first use and puts the previous URI (and `MLFLOW_TRACKING_URI`) back when it closes,
after the queue is flushed; flushing costs about a second, so it happens once, at the end of the run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

TAG_PREFIX = "agentrl."


@contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking URI at `uri`, then give back the previous one and the previous
    `MLFLOW_TRACKING_URI` (`mlflow.set_tracking_uri` also sets that variable, which later runs would read)."""
    import mlflow

    before, env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    if before == uri:
        yield
        return
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


class EpisodeTraceWriter:
    """Logs episodes (agentrl.runs.rollout_writer records) as traces of one MLflow run."""

    def __init__(self, *, tracking_uri: str, experiment_id: str, run_id: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.run_id = run_id
        self._uri: ExitStack | None = None

    def log(self, records: list[dict[str, Any]]) -> None:
        """Queue one trace per record; they are in the store once `close` returns (or sooner)."""
        if self._uri is None:
            self._uri = ExitStack()
            self._uri.enter_context(use_tracking_uri(self.tracking_uri))
        for record in records:
            _log_episode(record, self.experiment_id, self.run_id)

    def close(self) -> None:
        """Wait until every queued trace is stored, then give the process its previous tracking URI back."""
        import mlflow

        try:
            mlflow.flush_trace_async_logging()
        finally:
            if self._uri is not None:
                self._uri.close()
                self._uri = None


def trace_tags(record: dict[str, Any]) -> dict[str, str]:
    """The searchable tags of an episode's trace, e.g. `tags.\\`agentrl.step\\` = '3'`."""
    fields = ("step", "split", "episode_id", "task_id", "data_source", "reward", "termination_reason")
    tags = {TAG_PREFIX + k: str(record[k]) for k in fields if record.get(k) is not None}
    tags[TAG_PREFIX + "filtered"] = str(record["filtered"]).lower()
    return tags


def _log_episode(record: dict[str, Any], experiment_id: str, run_id: str) -> None:
    import mlflow
    from mlflow.entities import SpanType
    from mlflow.tracing.constant import TraceMetadataKey

    steps = [(t["name"], s) for t in record["trajectories"] for s in t["steps"]]
    total_ns = sum(int((s.get("latency_s") or 0.0) * 1e9) for _, s in steps)
    cursor = time.time_ns() - total_ns - 1000 * len(steps)
    first_messages = steps[0][1]["messages"] if steps else []
    root = mlflow.start_span_no_context(
        f"episode {record['episode_id']}",
        span_type=SpanType.AGENT,
        inputs={"task_id": record["task_id"], "messages": first_messages},
        attributes={k: record[k] for k in ("step", "split", "config_hash", "policy_version")},
        tags=trace_tags(record),
        metadata={TraceMetadataKey.SOURCE_RUN: run_id},
        experiment_id=experiment_id,
        start_time_ns=cursor,
    )
    conversation: list[dict[str, Any]] = []
    for index, (name, step) in enumerate(steps):
        conversation = _conversation(conversation, steps[index - 1][1] if index else None, step)
        cursor = _log_model_call(root, f"{name} call {index + 1}", conversation, step, cursor)
        results = steps[index + 1][1]["messages"] if index + 1 < len(steps) else []
        for call in step.get("tool_calls") or []:
            cursor = _log_tool_call(root, call, results, cursor)
    outputs = {
        k: record[k]
        for k in (
            "answer",
            "reward",
            "is_correct",
            "advantage",
            "termination_reason",
            "filter_reason",
            "error",
        )
    }
    root.end(
        outputs=outputs,
        status="ERROR" if record["termination_reason"] == "error" else "OK",
        end_time_ns=cursor,
    )


def _conversation(
    previous: list[dict[str, Any]], previous_step: dict[str, Any] | None, step: dict[str, Any]
) -> list[dict[str, Any]]:
    """The whole request of `step`: a saved step holds only its new messages when it continues the last one."""
    if previous_step is None or not step["continues_previous"]:
        return list(step["messages"])
    return [*previous, _reply(previous_step), *step["messages"]]


def _reply(step: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": step["response"]}
    if step.get("tool_calls"):
        message["tool_calls"] = step["tool_calls"]
    return message


def _log_model_call(
    root, name: str, conversation: list[dict[str, Any]], step: dict[str, Any], start: int
) -> int:
    import mlflow
    from mlflow.entities import SpanType

    logprobs = step["logprobs"]
    span = mlflow.start_span_no_context(
        name,
        span_type=SpanType.CHAT_MODEL,
        parent_span=root,
        inputs={"messages": conversation},
        attributes={
            "policy_version": step["policy_version"],
            "prompt_tokens": len(step["prompt_ids"]),
            "completion_tokens": len(step["response_ids"]),
            "mean_logprob": sum(logprobs) / len(logprobs) if logprobs else None,
            "advantage": step["advantage"],
            "excluded": step["excluded"],
        },
        start_time_ns=start,
    )
    end = start + max(int((step.get("latency_s") or 0.0) * 1e9), 1000)
    choice = {"index": 0, "message": _reply(step), "finish_reason": step["finish_reason"]}
    span.end(outputs={"choices": [choice]}, end_time_ns=end)
    return end


def _log_tool_call(root, call: dict[str, Any], results: list[dict[str, Any]], start: int) -> int:
    """A span for one tool call of the model; its output is the `tool` message that answered it, if any."""
    import mlflow
    from mlflow.entities import SpanType

    function = call.get("function") or {}
    arguments = function.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass  # kept as the model wrote it: a malformed call is worth seeing
    answer = next(
        (
            m.get("content")
            for m in results
            if m.get("role") == "tool" and m.get("tool_call_id") == call.get("id")
        ),
        None,
    )
    span = mlflow.start_span_no_context(
        str(function.get("name") or "tool"),
        span_type=SpanType.TOOL,
        parent_span=root,
        inputs={"arguments": arguments, "tool_call_id": call.get("id")},
        start_time_ns=start,
    )
    span.end(outputs={"content": answer}, end_time_ns=start + 1000)
    return start + 1000
