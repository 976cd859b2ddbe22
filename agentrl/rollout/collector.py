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
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import openai

from agentrl.flow import AgentFlow, RolloutContext, group_runner
from agentrl.rollout.client_transform import fast_transform, install_fast_transform
from agentrl.rollout.flow_client import flow_client, prime_platform
from agentrl.rollout.flow_job import FlowCall, FlowFailed, FlowSession
from agentrl.rollout.flow_workers import FlowWorkerPool
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
    group_calls: bool = True
    """`agent.group_calls`: a flow with `run_group` samples a task's n rollouts in one call."""
    max_n: int = 16
    """The largest `n` the gateway takes in one call (`rollout.max_n_per_request`)."""


class RolloutCollector:
    """Runs rollouts through a gateway and returns one Episode per (task, sample)."""

    def __init__(
        self,
        backend: SessionHost,
        model_name: str,
        limits: CollectorLimits,
        *,
        in_process: bool = True,
        num_workers: int = 0,
    ) -> None:
        """`in_process=False` reaches a gateway this process serves over TCP too (for measurements).
        `num_workers` (`agent.num_workers`): run the flows in that many worker processes (`flow_workers.py`),
        which reach the gateway over loopback TCP; 0 runs them on this process's event loop. Call `close`."""
        self.backend = backend
        self.model_name = model_name
        self.in_process = in_process
        self.limits = limits
        self.workers = FlowWorkerPool(num_workers) if num_workers > 0 else None
        self._rounds = 0
        self._gates: dict[int, asyncio.Semaphore] = {}
        self._gates_loop: asyncio.AbstractEventLoop | None = None
        install_fast_transform()
        prime_platform()

    def close(self) -> None:
        """Stop the flow worker processes, if any (safe to call more than once)."""
        if self.workers is not None:
            self.workers.close()

    def state_dict(self) -> dict[str, int]:
        """The round counter that session ids (and so sampling seeds) derive from; a checkpoint keeps it."""
        return {"rounds": self._rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._rounds = int(state["rounds"])

    async def collect(
        self, flow: AgentFlow, tasks: Sequence[Task], n: int, mode: str = "train", on_episode=None
    ) -> list[Episode]:
        """`n` rollouts of every task, at most `agent.n_parallel_tasks` at a time; never raises.

        A flow with a usable `run_group` (`agentrl.flow.group_runner`) samples each task's n rollouts in one call
        (`agent.group_calls`, n up to the gateway's `max_n`); a group takes n of the parallel slots."""
        run_group = group_runner(flow) if self.limits.group_calls and 1 < n <= self.limits.max_n else None
        slots = self.limits.n_parallel_tasks // n if run_group is not None else self.limits.n_parallel_tasks
        gate = self._gate(max(1, slots))
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

            async def one(task: Task, sample: int) -> list[Episode]:
                async with gate:
                    episode = await self._rollout(flow, task, sample, mode, http, round_id)
                if on_episode is not None:
                    on_episode(episode)
                return [episode]

            async def group(task: Task) -> list[Episode]:
                async with gate:
                    episodes = await self._group_rollout(flow, task, n, mode, http, round_id)
                for episode in episodes if on_episode is not None else ():
                    on_episode(episode)
                return episodes

            runs = (
                [group(task) for task in tasks]
                if run_group is not None
                else [one(task, i) for task in tasks for i in range(n)]
            )
            async with LoopLagWatchdog(flow, self.limits.loop_lag_warning) as watchdog:
                episodes = [e for batch in await asyncio.gather(*runs) for e in batch]
        blocked = watchdog.longest_stall >= self.limits.loop_lag_warning
        for episode in episodes:
            if episode.termination_reason == TerminationReason.TIMEOUT and blocked:
                episode.error = (
                    f"{episode.error or ''}\nthe event loop was blocked for {watchdog.longest_stall:.1f} s while "
                    f"{watchdog.flow_name} ran: use async calls or asyncio.to_thread in its run, or "
                    "agent.num_workers (see the warning)"
                )
            if episode.termination_reason in _COUNTED:
                record_failure(_COUNTED[episode.termination_reason], episode.error)
        return episodes

    def _gate(self, slots: int) -> asyncio.Semaphore:
        """The limit on rollouts in flight, shared by the collections running at once on this loop (the
        asynchronous loop's batches): the next batch's rollouts take the places the last rollouts of the batch
        before leave, first come first served, and never more than `agent.n_parallel_tasks` run together (more
        than the engine has slots for would push the parked histories of agents waiting on tools out of its
        cache)."""
        loop = asyncio.get_running_loop()
        if self._gates_loop is not loop:
            self._gates, self._gates_loop = {}, loop
        return self._gates.setdefault(slots, asyncio.Semaphore(slots))

    async def _rollout(
        self, flow: AgentFlow, task: Task, sample: int, mode: str, http: httpx.AsyncClient, round_id: int
    ) -> Episode:
        episode = Episode()
        for attempt in range(self.limits.retry_limit):
            # Deterministic ids: the gateway derives each call's sampling seed from them (repeatable runs).
            session_id = f"{mode}{round_id}-{task.id}.{sample}.a{attempt}"
            run = await self._run_session(session_id, mode, http, FlowCall(flow, task))
            episode = self._episode(task, flow.name, run.result, run, run.traces)
            if not run.retryable or attempt == self.limits.retry_limit - 1:
                break
        episode.id = f"{task.id}:{sample}"
        episode.metrics["retries"] = float(attempt)
        return episode

    async def _group_rollout(
        self,
        flow: AgentFlow,
        task: Task,
        n: int,
        mode: str,
        http: httpx.AsyncClient,
        round_id: int,
    ) -> list[Episode]:
        """A task's n rollouts from one `run_group` call: choice i's trace and result make episode i. A failure
        of the call fails all n (and is retried as a whole)."""
        for attempt in range(self.limits.retry_limit):
            session_id = f"{mode}{round_id}-{task.id}.group.a{attempt}"
            run = await self._run_session(session_id, mode, http, FlowCall(flow, task, n))
            if run.reason is None and (problem := _group_problem(run.result, run.traces, n)) is not None:
                run.reason, run.error, run.result = TerminationReason.ERROR, problem, None
            if not run.retryable or attempt == self.limits.retry_limit - 1:
                break
        episodes = []
        for sample in range(n):
            result = run.result[sample] if run.result is not None else None
            traces = [run.traces[sample]] if len(run.traces) == n else []
            episode = self._episode(task, flow.name, result, run, traces)
            episode.id = f"{task.id}:{sample}"
            episode.metrics["retries"] = float(attempt)
            episodes.append(episode)
        return episodes

    async def _run_session(
        self, session_id: str, mode: str, http: httpx.AsyncClient, call: FlowCall
    ) -> SessionRun:
        """Run `call` in a fresh gateway session (here, or in a flow worker); what it returned or why it failed,
        and the session's traces."""
        base_url = self.backend.open_session(session_id, mode, max_calls=self.limits.max_steps)
        session = FlowSession(
            base_url, self.model_name, session_id, self.limits.max_steps, mode, self.limits.timeout
        )
        run = SessionRun(started=time.perf_counter())
        try:
            running = (
                self.workers.run(call, session)
                if self.workers is not None
                else run_flow(call, session.context(flow_client(base_url, self.limits.timeout, http)))
            )
            run.result = await asyncio.wait_for(running, timeout=self.limits.timeout)
        except asyncio.TimeoutError:
            run.reason = TerminationReason.TIMEOUT
            run.error = f"rollout exceeded agent.timeout={self.limits.timeout}s"
        except FlowFailed as failed:  # in a flow worker: classified there (`failure_of`)
            run.reason, run.error, run.retryable = failed.reason, failed.error, failed.retryable
        except Exception as exc:  # noqa: BLE001 - a failing agent costs one rollout, not the run
            run.reason, run.error, run.retryable = failure_of(exc)
        finally:
            run.traces = self.backend.session_traces(session_id)
            run.refused = self.backend.refused_calls(session_id)
            run.refused_prompts = self.backend.refused_prompts(session_id)
            self.backend.close_session(session_id)
        return run

    def _episode(self, task: Task, flow_name: str, result, run: SessionRun, traces: list[Trace]) -> Episode:
        """The episode of one rollout: its result and traces, its termination reason, its error."""
        reason, error = run.reason, run.error
        try:
            episode = build_episode(task, flow_name, result if reason is None else None, traces)
        except TypeError as exc:
            reason, error = TerminationReason.ERROR, str(exc)
            episode = build_episode(task, flow_name, None, traces)
        episode.termination_reason = reason or classify_termination(
            episode, traces, self.limits, run.refused, run.refused_prompts
        )
        episode.error = error
        episode.metrics.update(
            num_model_calls=float(len(traces)), latency_s=time.perf_counter() - run.started
        )
        return episode


@dataclass
class SessionRun:
    """What happened in one gateway session: the flow's result, or why it ended without one."""

    started: float
    result: Any = None
    reason: TerminationReason | None = None
    error: str | None = None
    retryable: bool = False
    traces: list[Trace] = field(default_factory=list)
    refused: int = 0
    refused_prompts: int = 0


def _group_problem(results: Any, traces: list[Trace], n: int) -> str | None:
    """Why a `run_group` call cannot be split into n episodes, or None."""
    if not isinstance(results, list) or len(results) != n:
        got = f"a list of {len(results)}" if isinstance(results, list) else type(results).__name__
        return f"run_group returned {got}; expected a list of n={n} results, choice i's first"
    if len(traces) != n:
        return f"run_group made calls with {len(traces)} choices in all; expected one call with n={n} choices"
    return None


class FlowTimeoutError(Exception):
    """A TimeoutError raised inside the flow (a tool's own deadline): an `error`, not an `agent.timeout`."""


def failure_of(exc: BaseException) -> tuple[TerminationReason, str | None, bool]:
    """Why a flow that raised `exc` ended: (termination reason, error text, whether a retry may help). A gateway
    refusal (`openai.BadRequestError` with its error.code, never by text) keeps its own reason."""
    if isinstance(exc, openai.BadRequestError) and (reason := refusal_reason(exc.code)) is not None:
        return reason, None, False
    return (
        TerminationReason.ERROR,
        f"{exc!r}\n{''.join(traceback.format_exception(exc))}",
        isinstance(exc, _RETRYABLE),
    )


async def run_flow(call: FlowCall, ctx: RolloutContext) -> Any:
    """`call` on `ctx`: the flow's `run` (or its `run_group` for a group), with the flow's openai calls on the
    fast request path (client_transform.py)."""
    # asyncio.TimeoutError is the builtin TimeoutError, so without this a flow's own timeout would be
    # taken for `agent.timeout` (and kept for training as a timeout instead of dropped as an error).
    try:
        with fast_transform():
            if call.n is None:
                return await call.flow.run(call.task, ctx)
            return await group_runner(call.flow)(call.task, ctx, call.n)
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
