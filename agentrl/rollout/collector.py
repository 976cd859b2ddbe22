"""Collector: runs a flow `n` times per task, concurrently, and turns what happened into Episodes.

Every failure becomes data: an exception is an `error` episode with its traceback, a rollout over
`agent.timeout` is `timeout`, too many model calls is `max_turns_exceeded`, and so on. Steps get their token
ids and logprobs from the gateway's traces of the rollout's own session (token in, token out); a step whose
text disagrees with every trace is counted and excluded, never trained on. Errors and timeouts are counted for
the console's line of the step (`tracking/failures.py`), and a flow that blocks the event loop is named in a
warning (`loop_watchdog.py`) and in the reason of the timeouts it caused.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
import openai

from agentrl.flow import AgentFlow, RolloutContext
from agentrl.rollout.client_transform import fast_transform, install_fast_transform
from agentrl.rollout.flow_client import flow_client, prime_platform
from agentrl.rollout.gateway import refusal_reason
from agentrl.rollout.http_transport import ShardedHTTPTransport
from agentrl.rollout.loop_watchdog import LoopLagWatchdog
from agentrl.rollout.uvicorn_thread import InProcessFirstTransport
from agentrl.tracking.failures import record_failure
from agentrl.types import Episode, Step, Task, TerminationReason, Trace, Trajectory

_RETRYABLE = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError)
_COUNTED = {TerminationReason.ERROR: "flow_error", TerminationReason.TIMEOUT: "timeout"}
"""Termination reasons the console's line of the step counts (`tracking/failures.py`)."""


class SessionHost(Protocol):
    """What the collector needs from the gateway: sessions, and the traces recorded under them."""

    def open_session(self, session_id: str, mode: str, max_calls: int | None = None) -> str:
        """Register a session (at most `max_calls` model calls) and return its OpenAI base URL."""

    def refused_calls(self, session_id: str) -> int:
        """Model calls the gateway refused because the session reached `max_calls`."""

    def refused_prompts(self, session_id: str) -> int:
        """Model calls the gateway refused because their prompt passed `data.max_prompt_length`."""

    def session_traces(self, session_id: str) -> list[Trace]:
        """Traces of the session's model calls, in call order."""

    def close_session(self, session_id: str) -> None:
        """Forget the session and its traces."""


@dataclass(frozen=True)
class CollectorLimits:
    """The agent-loop limits (`agent.*`, `data.max_prompt_length`) a rollout runs under."""

    max_steps: int = 8
    n_parallel_tasks: int = 64
    retry_limit: int = 1
    """Attempts per rollout: a retryable failure (connection error, server 5xx) is tried again."""
    timeout: float = 120.0
    max_prompt_length: int = 1024
    loop_lag_warning: float = 2.0
    """Seconds the event loop may go without running before the watchdog warns that the flow blocks it."""


class RolloutCollector:
    """Runs rollouts through a gateway and returns one Episode per (task, sample)."""

    def __init__(
        self, backend: SessionHost, model_name: str, limits: CollectorLimits, *, in_process: bool = True
    ) -> None:
        """`in_process=False` reaches a gateway this process serves over TCP too (for measurements)."""
        self.backend = backend
        self.model_name = model_name
        self.in_process = in_process
        self.limits = limits
        self._rounds = 0
        install_fast_transform()
        prime_platform()

    def state_dict(self) -> dict[str, int]:
        """The round counter that session ids (and so sampling seeds) derive from; a checkpoint keeps it."""
        return {"rounds": self._rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._rounds = int(state["rounds"])

    async def collect(
        self, flow: AgentFlow, tasks: Sequence[Task], n: int, mode: str = "train", on_episode=None
    ) -> list[Episode]:
        """`n` rollouts of every task, at most `agent.n_parallel_tasks` at a time; never raises."""
        gate = asyncio.Semaphore(self.limits.n_parallel_tasks)
        round_id = self._rounds
        self._rounds += 1

        # One HTTP client for every rollout: building an OpenAI client with its own costs ~15 ms each.
        def network() -> ShardedHTTPTransport:
            return ShardedHTTPTransport(
                max_connections=self.limits.n_parallel_tasks * 2,
                max_keepalive_connections=self.limits.n_parallel_tasks,
            )

        # A gateway in this process (the trainer's) is reached through ASGI, without a TCP hop; the network
        # transport is only built if a request leaves the process.
        transport: httpx.AsyncBaseTransport = (
            InProcessFirstTransport(network) if self.in_process else network()
        )
        async with httpx.AsyncClient(timeout=self.limits.timeout, transport=transport) as http:

            async def one(task: Task, sample: int) -> Episode:
                async with gate:
                    episode = await self._rollout(flow, task, sample, mode, http, round_id)
                if on_episode is not None:
                    on_episode(episode)
                return episode

            async with LoopLagWatchdog(flow, self.limits.loop_lag_warning) as watchdog:
                episodes = list(await asyncio.gather(*(one(task, i) for task in tasks for i in range(n))))
        blocked = watchdog.longest_stall >= self.limits.loop_lag_warning
        for episode in episodes:
            if episode.termination_reason == TerminationReason.TIMEOUT and blocked:
                episode.error = (
                    f"{episode.error or ''}\nthe event loop was blocked for {watchdog.longest_stall:.1f} s while "
                    f"{watchdog.flow_name} ran: use async calls or asyncio.to_thread in its run (see the warning)"
                )
            if episode.termination_reason in _COUNTED:
                record_failure(_COUNTED[episode.termination_reason], episode.error)
        return episodes

    async def _rollout(
        self, flow: AgentFlow, task: Task, sample: int, mode: str, http: httpx.AsyncClient, round_id: int
    ) -> Episode:
        episode = Episode()
        for attempt in range(self.limits.retry_limit):
            # Deterministic ids: the gateway derives each call's sampling seed from them (repeatable runs).
            session_id = f"{mode}{round_id}-{task.id}.{sample}.a{attempt}"
            episode = await self._attempt(flow, task, session_id, mode, http)
            retryable = episode.metrics.pop("_retryable", 0.0)
            if not retryable or attempt == self.limits.retry_limit - 1:
                break
        episode.id = f"{task.id}:{sample}"
        episode.metrics["retries"] = float(attempt)
        return episode

    async def _attempt(
        self, flow: AgentFlow, task: Task, session_id: str, mode: str, http: httpx.AsyncClient
    ) -> Episode:
        base_url = self.backend.open_session(session_id, mode, max_calls=self.limits.max_steps)
        client = flow_client(base_url, self.limits.timeout, http)
        ctx = RolloutContext(
            client=client,
            model=self.model_name,
            session_id=session_id,
            base_url=base_url,
            max_steps=self.limits.max_steps,
            mode=mode,
        )
        started = time.perf_counter()
        result, reason, error, retryable = None, None, None, False
        try:
            result = await asyncio.wait_for(_run_flow(flow, task, ctx), timeout=self.limits.timeout)
        except asyncio.TimeoutError:
            reason, error = (
                TerminationReason.TIMEOUT,
                f"rollout exceeded agent.timeout={self.limits.timeout}s",
            )
        except openai.BadRequestError as exc:
            reason = refusal_reason(exc.code)  # the gateway's refusals, by error.code (never by text)
            if reason is None:
                reason, error = TerminationReason.ERROR, f"{exc!r}\n{traceback.format_exc()}"
        except _RETRYABLE as exc:
            reason, error, retryable = TerminationReason.ERROR, f"{exc!r}\n{traceback.format_exc()}", True
        except Exception as exc:  # noqa: BLE001 - a failing agent costs one rollout, not the run
            reason, error = TerminationReason.ERROR, f"{exc!r}\n{traceback.format_exc()}"
        finally:
            traces = self.backend.session_traces(session_id)
            refused = self.backend.refused_calls(session_id)
            refused_prompts = self.backend.refused_prompts(session_id)
            self.backend.close_session(session_id)
        try:
            episode = (
                build_episode(task, flow.name, result, traces)
                if reason is None
                else build_episode(task, flow.name, None, traces)
            )
        except TypeError as exc:
            reason, error = TerminationReason.ERROR, str(exc)
            episode = build_episode(task, flow.name, None, traces)
        episode.termination_reason = reason or classify_termination(
            episode, traces, self.limits, refused, refused_prompts
        )
        episode.error = error
        episode.metrics.update(num_model_calls=float(len(traces)), latency_s=time.perf_counter() - started)
        if retryable:
            episode.metrics["_retryable"] = 1.0
        return episode


class FlowTimeoutError(Exception):
    """A TimeoutError raised inside the flow (a tool's own deadline): an `error`, not an `agent.timeout`."""


async def _run_flow(flow: AgentFlow, task: Task, ctx: RolloutContext):
    # asyncio.TimeoutError is the builtin TimeoutError, so without this a flow's own timeout would be
    # taken for `agent.timeout` (and kept for training as a timeout instead of dropped as an error).
    try:
        # The flow's openai calls skip openai's walk of plain request bodies (client_transform.py).
        with fast_transform():
            return await flow.run(task, ctx)
    except asyncio.TimeoutError as exc:
        raise FlowTimeoutError(f"the flow raised {exc!r} before agent.timeout") from exc


def step_from_trace(trace: Trace) -> Step:
    """A Step carrying exactly the tokens and logprobs the engine produced for one call."""
    return Step(
        prompt_ids=trace.prompt_ids,
        response_ids=trace.response_ids,
        logprobs=trace.logprobs,
        images=trace.images or [],
        messages=trace.messages or [],
        model_response=trace.completion_text,
        tool_calls=trace.tool_calls,
        finish_reason=trace.finish_reason,
        info={
            "policy_version": trace.policy_version,
            "request_id": trace.request_id,
            "latency_s": trace.latency_s,
            "server": trace.server,
        },
    )


def build_episode(task: Task, flow_name: str, result, traces: list[Trace]) -> Episode:
    """Turn what `flow.run` returned into an Episode whose steps carry the traced tokens."""
    if result is None or isinstance(result, str):
        steps = [step_from_trace(t) for t in traces]
        return Episode(
            task_id=task.id,
            task=task.data,
            answer=result,
            trajectories=[Trajectory(name=flow_name, steps=steps)],
        )
    if isinstance(result, Trajectory):
        episode = Episode(task_id=task.id, task=task.data, trajectories=[result])
    elif isinstance(result, Episode):
        episode = result.model_copy(update={"task_id": task.id, "task": task.data})
    else:
        raise TypeError(f"flow.run returned {type(result).__name__}; expected str, Trajectory or Episode")
    mismatches = fill_steps_from_traces(episode.trajectories, traces)
    episode.metrics["trace_mismatch"] = float(mismatches)
    if episode.answer is None:
        last = [s for t in episode.trajectories for s in t.steps]
        episode.answer = last[-1].model_response if last else None
    return episode


def fill_steps_from_traces(trajectories: list[Trajectory], traces: list[Trace]) -> int:
    """Give each step the tokens of its trace; returns how many steps matched no trace.

    A step that states its `model_response` is matched to the first unused trace with that completion text;
    a step without text takes the next unused trace in call order. A trajectory with no steps gets one step
    per remaining trace. Unmatched steps are marked `info["excluded"] = "trace_mismatch"`.
    """
    unused = list(traces)
    mismatches = 0
    for trajectory in trajectories:
        if not trajectory.steps:
            trajectory.steps = [step_from_trace(t) for t in unused]
            unused = []
            continue
        for i, step in enumerate(trajectory.steps):
            if step.model_response:
                match = next((t for t in unused if t.completion_text == step.model_response), None)
            else:
                match = unused[0] if unused else None
            if match is None:
                step.info["excluded"] = "trace_mismatch"
                mismatches += 1
                continue
            unused.remove(match)
            filled = step_from_trace(match)
            trajectory.steps[i] = filled.model_copy(
                update={"reward": step.reward, "done": step.done, "info": {**step.info, **filled.info}}
            )
    return mismatches


def classify_termination(
    episode: Episode,
    traces: list[Trace],
    limits: CollectorLimits,
    refused_calls: int = 0,
    refused_prompts: int = 0,
) -> TerminationReason:
    """Why a rollout that returned normally ended, from its traces and the agent limits.

    Any call cut at the length limit makes the episode `max_response_length_exceeded`, not only the
    last one: a multi-turn agent that goes on after a cut-off turn (finish reasons ["length",
    "stop"]) acted on a truncated answer, and compact filtering must be able to drop it.
    """
    if episode.termination_reason != TerminationReason.UNKNOWN:
        return episode.termination_reason
    if refused_calls or len(traces) > limits.max_steps:
        return TerminationReason.MAX_TURNS_EXCEEDED
    if refused_prompts or any(len(t.prompt_ids) > limits.max_prompt_length for t in traces):
        return TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED
    if any(t.finish_reason == "length" for t in traces):
        return TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
    return TerminationReason.ENV_DONE
