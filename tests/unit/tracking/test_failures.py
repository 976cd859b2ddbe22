"""The console's line of failed rollouts: flow errors and timeouts from the real collector, evaluator errors from
`score_episode` (an exception, NaN, a string), each counted with its first reason, drained once per step."""

from __future__ import annotations

import asyncio

import pytest

from agentrl import AgentFlow, Episode, Task, TerminationReason, evaluator
from agentrl.evaluator import score_episode
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.tracking.console import ConsoleBackend
from agentrl.tracking.failures import FailureCounts, drain_failures, format_failure_line, record_failure
from agentrl.types import SamplingParams


class FailingFlow(AgentFlow):
    """Task `boom` raises, task `slow` outlives agent.timeout, the others answer."""

    async def run(self, task, ctx):
        if task.id.startswith("boom"):
            raise RuntimeError(f"tool crashed on {task.id}")
        if task.id == "slow":
            await asyncio.sleep(5)
        return "ok"


@pytest.fixture(autouse=True)
def _fresh_tally():
    drain_failures()
    yield
    drain_failures()


def test_the_line_counts_each_kind_with_its_first_reason():
    assert format_failure_line(FailureCounts(), 3) is None  # nothing failed: no line
    record_failure("flow_error", "Traceback (most recent call last):\n  ...\nRuntimeError: first")
    record_failure("flow_error", "RuntimeError: second")
    record_failure("timeout", "rollout exceeded agent.timeout=2.0s")
    line = format_failure_line(drain_failures(), 3)
    assert line == (
        "step 3 | failed rollouts: 2 flow errors, 1 timeout, 0 evaluator errors"
        " | first flow error: RuntimeError: first | first timeout: rollout exceeded agent.timeout=2.0s"
    )
    assert drain_failures().total == 0  # drained
    with pytest.raises(ValueError, match="failure kind must be one of"):
        record_failure("oops", "x")


def test_the_collector_counts_flow_errors_and_timeouts():
    pool = RolloutPool(["http://127.0.0.1:9"], model_name="m")  # the flows make no model call
    with Gateway(pool, sampling_train=SamplingParams(max_tokens=2)) as gateway:
        collector = RolloutCollector(gateway, "m", CollectorLimits(timeout=0.3))
        tasks = [Task(id=i) for i in ("boom-1", "boom-2", "slow", "fine")]
        episodes = asyncio.run(collector.collect(FailingFlow(), tasks, 1))
    reasons = [e.termination_reason for e in episodes]
    assert reasons.count(TerminationReason.ERROR) == 2 and reasons.count(TerminationReason.TIMEOUT) == 1
    failures = drain_failures()
    assert failures.counts == {"flow_error": 2, "timeout": 1, "evaluator_error": 0}
    assert failures.first["flow_error"] in (
        "RuntimeError: tool crashed on boom-1",
        "RuntimeError: tool crashed on boom-2",
    )
    assert failures.first["timeout"] == "rollout exceeded agent.timeout=0.3s"


def test_the_console_prints_the_line_after_the_steps_own(capsys):
    record_failure("timeout", "left over from an earlier run in this process")
    console = ConsoleBackend()  # a new run starts from zero
    record_failure("evaluator_error", "ValueError: the evaluator returned a non-finite reward (nan)")
    record_failure("flow_error", "KeyError: 'answer'")
    console.log({"critic/full-score/mean": 0.5}, step=7)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "step 7 | reward 0.5",
        "step 7 | failed rollouts: 1 flow error, 0 timeouts, 1 evaluator error"
        " | first flow error: KeyError: 'answer'"
        " | first evaluator error: ValueError: the evaluator returned a non-finite reward (nan)",
    ]
    console.log({"critic/full-score/mean": 1.0}, step=8)
    assert capsys.readouterr().out.splitlines() == ["step 8 | reward 1"]  # nothing failed since


def test_score_episode_counts_nan_strings_and_exceptions():
    results = iter([float("nan"), "right", ZeroDivisionError("no denominator"), 1.0])

    @evaluator
    def grade(task, episode):
        value = next(results)
        if isinstance(value, Exception):
            raise value
        return value

    episodes = [score_episode(grade, Task(id=str(i)), Episode(answer="4")) for i in range(4)]
    assert [e.metrics.get("evaluator_error", 0.0) for e in episodes] == [1.0, 1.0, 1.0, 0.0]
    failures = drain_failures()
    assert failures.counts["evaluator_error"] == 3
    assert failures.first["evaluator_error"] == "ValueError: the evaluator returned a non-finite reward (nan)"
