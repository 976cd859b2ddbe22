"""One rollout as the collector hands it to a flow, here or in a flow worker process: the call and its session.

Both are plain data (a flow worker gets them pickled), so the collector runs a rollout the same way whether its
flow runs on the trainer's event loop or in a worker (`flow_workers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.flow import AgentFlow, RolloutContext
from agentrl.types import Task, TerminationReason

KEY_ENV = "AGENTRL_FLOW_WORKER_KEY"
"""The environment variable that carries a flow worker pool's authentication key (hex) to its workers."""


@dataclass(frozen=True)
class FlowCall:
    """`flow.run(task, ctx)`, or with `n` the flow's `run_group(task, ctx, n)` (a task's n rollouts in one call)."""

    flow: AgentFlow
    task: Task
    n: int | None = None


@dataclass(frozen=True)
class FlowSession:
    """The gateway session a rollout runs in, and its limits: what its `RolloutContext` is made of."""

    base_url: str
    model: str
    session_id: str
    max_steps: int
    mode: str
    timeout: float

    def context(self, client: Any) -> RolloutContext:
        """The flow's context, with `client` (an `openai.AsyncOpenAI` bound to `base_url`)."""
        return RolloutContext(
            client=client,
            model=self.model,
            session_id=self.session_id,
            base_url=self.base_url,
            max_steps=self.max_steps,
            mode=self.mode,
        )


class FlowFailed(Exception):
    """A flow that failed in a worker process, as the worker classified it (`collector.failure_of`)."""

    def __init__(self, reason: TerminationReason, error: str | None, retryable: bool) -> None:
        super().__init__(error or reason.value)
        self.reason, self.error, self.retryable = reason, error, retryable
