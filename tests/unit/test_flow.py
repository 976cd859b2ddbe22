"""AgentFlow and the @agent_flow decorator."""

from __future__ import annotations

import asyncio

import pytest

from agentrl import AgentFlow, RolloutContext, Task, agent_flow


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
