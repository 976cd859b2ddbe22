"""AgentFlow and the @agent_flow decorator."""

from __future__ import annotations

import asyncio

import pytest

from agentrl import AgentFlow, RolloutContext, Task, agent_flow
from agentrl.flow import SingleTurnChatFlow, group_runner


def _ctx() -> RolloutContext:
    return RolloutContext(client=None, model="m", session_id="s", base_url="http://x", max_steps=2)


def test_agent_flow_refuses_a_plain_function():
    def solve(task, ctx):
        return "4"

    with pytest.raises(TypeError, match="async def"):
        agent_flow(solve)
    with pytest.raises(TypeError, match="async def"):
        agent_flow(name="solver")(solve)


def test_agent_flow_wraps_an_async_function_with_its_name_and_doc():
    @agent_flow
    async def solve(task, ctx):
        """Answers with the task's id."""
        return f"{task.id}:{ctx.max_steps}"

    @agent_flow(name="solver")
    async def named(task, ctx):
        return task["question"]

    assert isinstance(solve, AgentFlow) and isinstance(named, AgentFlow)
    assert solve.name == "agent" and named.name == "solver"
    assert solve.__doc__ == "Answers with the task's id."
    assert asyncio.run(solve.run(Task(id="t7"), _ctx())) == "t7:2"
    assert asyncio.run(named.run(Task(id="t", data={"question": "q?"}), _ctx())) == "q?"


def test_agent_flow_subclass_must_implement_run():
    class Incomplete(AgentFlow):
        pass

    with pytest.raises(TypeError):
        Incomplete()


def test_group_runner_is_the_flows_run_group_unless_run_is_overridden_below_it():
    """A subclass that changes `run` only would have its `run` skipped by an inherited `run_group`."""

    class OwnGroup(SingleTurnChatFlow):
        async def run_group(self, task, ctx, n):
            return ["x"] * n

    class OwnRun(SingleTurnChatFlow):
        async def run(self, task, ctx):
            return "x"

    class Both(OwnRun):
        async def run_group(self, task, ctx, n):
            return ["x"] * n

    @agent_flow
    async def plain(task, ctx):
        return "x"

    assert group_runner(SingleTurnChatFlow()).__func__ is SingleTurnChatFlow.run_group
    assert group_runner(OwnGroup()).__func__ is OwnGroup.run_group
    assert group_runner(Both()).__func__ is Both.run_group
    assert group_runner(OwnRun()) is None
    assert group_runner(plain) is None
