"""A flow that blocks the collection's event loop is named in a warning (and in the timeouts it caused); a flow
that awaits is not. Real flows through the real collector and gateway; no model call is needed."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from agentrl import AgentFlow, Task, TerminationReason, agent_flow
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.tracking.failures import drain_failures
from agentrl.types import SamplingParams

WATCHDOG_LOGGER = "agentrl.rollout.loop_watchdog"


class BlockingFlow(AgentFlow):
    """Calls a blocking sleep in `run`: the mistake the watchdog is for."""

    def __init__(self, block: float, then_await: float = 0.0) -> None:
        self.block, self.then_await = block, then_await

    async def run(self, task, ctx):
        time.sleep(self.block)
        await asyncio.sleep(self.then_await)
        return "done"


class AwaitingFlow(AgentFlow):
    async def run(self, task, ctx):
        await asyncio.sleep(0.4)
        return "done"


@pytest.fixture
def gateway():
    pool = RolloutPool(["http://127.0.0.1:9"], model_name="m")  # never called: the flows make no model call
    with Gateway(pool, sampling_train=SamplingParams(max_tokens=2)) as gw:
        yield gw


def _collect(gateway, flow, n=2, **limits):
    collector = RolloutCollector(gateway, "m", CollectorLimits(loop_lag_warning=0.2, **limits))
    return asyncio.run(collector.collect(flow, [Task(id="t")], n))


def test_a_blocking_flow_is_named_with_the_fix(gateway, caplog):
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOGGER)
    episodes = _collect(gateway, BlockingFlow(block=0.6))
    assert [e.termination_reason for e in episodes] == [TerminationReason.ENV_DONE] * 2
    [record] = [r for r in caplog.records if r.name == WATCHDOG_LOGGER]  # once per collection
    message = record.getMessage()
    assert "BlockingFlow" in message and "blocked for" in message
    assert "asyncio.to_thread" in message and "async calls" in message
    assert (
        "test_loop_watchdog.py" in message and "time.sleep(self.block)" in message
    )  # the line it is stuck on


def test_timeouts_caused_by_a_blocked_loop_say_so(gateway, caplog):
    drain_failures()
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOGGER)
    episodes = _collect(gateway, BlockingFlow(block=0.5, then_await=5.0), timeout=0.3)
    assert [e.termination_reason for e in episodes] == [TerminationReason.TIMEOUT] * 2
    assert all("event loop was blocked" in e.error and "BlockingFlow" in e.error for e in episodes)
    failures = drain_failures()
    assert failures.counts["timeout"] == 2 and "asyncio.to_thread" in failures.first["timeout"]


def test_a_flow_that_awaits_raises_no_warning(gateway, caplog):
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOGGER)
    episodes = _collect(gateway, AwaitingFlow(), n=4)
    assert all(e.termination_reason == TerminationReason.ENV_DONE for e in episodes)
    assert not [r for r in caplog.records if r.name == WATCHDOG_LOGGER]


def test_an_agent_flow_function_is_named_by_its_own_name(gateway, caplog):
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOGGER)

    @agent_flow
    async def sleepy_solver(task, ctx):
        time.sleep(0.5)
        return "done"

    _collect(gateway, sleepy_solver, n=1)
    [record] = [r for r in caplog.records if r.name == WATCHDOG_LOGGER]
    assert "sleepy_solver" in record.getMessage() and "time.sleep(0.5)" in record.getMessage()
