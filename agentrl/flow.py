"""AgentFlow: the user's agent, written as plain async Python against the OpenAI API.

A flow receives a `Task` and a `RolloutContext` whose `client` is a real `openai.AsyncOpenAI` routed to one
gateway session, so every model call it makes is traced with exact token ids and logprobs. The flow returns
its final answer as a string, a `Trajectory`, or a whole `Episode`; the collector fills in tokens from traces.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Episode, Task, Trajectory

FlowResult = str | Trajectory | Episode


@dataclass
class RolloutContext:
    """What one rollout of a flow gets: a client bound to its own gateway session, and its limits."""

    client: Any
    """`openai.AsyncOpenAI` whose base URL is `{gateway}/sessions/{session_id}/v1`."""
    model: str
    """The model name to pass to `client.chat.completions.create(model=...)`: the served name
    (`actor_rollout_ref.model.path`). The gateway answers any other name with a 404, as vLLM does."""
    session_id: str
    base_url: str
    max_steps: int
    """`agent.max_steps`: the gateway refuses further calls (an `openai.BadRequestError` with code
    `max_turns_exceeded`), and the episode ends as `max_turns_exceeded`."""
    mode: str = "train"
    """`train` or `val`: the gateway applies the matching sampling parameters."""
    metadata: dict[str, Any] = field(default_factory=dict)


class AgentFlow(ABC):
    """Base class for agents. Subclass it and write `async def run(self, task, ctx)`."""

    name: str = "agent"
    """Trajectory name used when the flow returns a plain string."""

    @abstractmethod
    async def run(self, task: Task, ctx: RolloutContext) -> FlowResult:
        """Run the agent on one task; return the final answer, a Trajectory or an Episode."""

    run_group: Callable[[Task, RolloutContext, int], Awaitable[list[FlowResult]]] | None = None
    """Optional, for a flow that makes exactly one model call: `async def run_group(self, task, ctx, n)` makes that
    call once with `n=n` and returns the n rollouts' results, choice i's first. The collector then samples a
    task's `rollout.n` rollouts in one request (`agent.group_calls`), where `run` would make n requests that each
    pay the client's, the gateway's and the server's work for a call. Used only where the class that defines
    `run_group` is the one of `run` or a subclass of it (see `group_runner`)."""


def group_runner(
    flow: AgentFlow,
) -> Callable[[Task, RolloutContext, int], Awaitable[list[FlowResult]]] | None:
    """`flow.run_group`, or None when the flow has none or its `run` is overridden below its `run_group` (a
    subclass that changes `run` only): the inherited `run_group` would skip the subclass's own `run`."""
    if getattr(flow, "run_group", None) is None:
        return None
    mro = type(flow).__mro__
    group_owner = next(cls for cls in mro if "run_group" in cls.__dict__)
    run_owner = next(cls for cls in mro if "run" in cls.__dict__)
    return flow.run_group if issubclass(group_owner, run_owner) else None


class _FunctionFlow(AgentFlow):
    def __init__(self, fn: Callable[[Task, RolloutContext], Awaitable[FlowResult]], name: str) -> None:
        self._fn = fn
        self.name = name
        self.__doc__ = fn.__doc__

    async def run(self, task: Task, ctx: RolloutContext) -> FlowResult:
        return await self._fn(task, ctx)

    def __repr__(self) -> str:
        return f"agent_flow({self._fn.__qualname__})"


def agent_flow(fn: Callable[..., Awaitable[FlowResult]] | None = None, *, name: str = "agent") -> Any:
    """Turn `async def fn(task, ctx)` into an AgentFlow: `@agent_flow` or `@agent_flow(name="solver")`."""

    def wrap(f: Callable[..., Awaitable[FlowResult]]) -> AgentFlow:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"@agent_flow needs an `async def` function taking (task, ctx); got {f!r}")
        return _FunctionFlow(f, name)

    return wrap(fn) if fn is not None else wrap


class SingleTurnChatFlow(AgentFlow):
    """Sends the task's `prompt` messages (verl row format) once and returns the reply's text.

    The flow behind GSM8K-style data and the default arithmetic run; a starting point for your own.
    """

    def __init__(self, prompt_key: str = "prompt") -> None:
        self.prompt_key = prompt_key

    async def run(self, task: Task, ctx: RolloutContext) -> str:
        reply = await ctx.client.chat.completions.create(model=ctx.model, messages=task[self.prompt_key])
        return reply.choices[0].message.content or ""

    async def run_group(self, task: Task, ctx: RolloutContext, n: int) -> list[str]:
        """`n` rollouts of `run` in one call with `n` choices."""
        reply = await ctx.client.chat.completions.create(model=ctx.model, messages=task[self.prompt_key], n=n)
        return [choice.message.content or "" for choice in sorted(reply.choices, key=lambda c: c.index)]
