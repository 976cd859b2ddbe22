"""Flows in worker processes (`agent.num_workers`) against a real rollout stack: the same episodes as in the
trainer's process, failures classified as there, a hung rollout cancelled in its worker, a dead worker
replaced, and no worker left behind by a training run."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from agentrl import Episode, Task, TerminationReason, Trajectory, agent_flow
from agentrl.config import ConfigError, load_config
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from tests.integration.training.test_collector import MESSAGES, stack  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.slow


def collect(stack, flow, tasks, n=1, workers=2, **limits) -> list[Episode]:  # noqa: F811
    async def run() -> list[Episode]:
        collector = RolloutCollector(
            stack.backend, stack.model_name, CollectorLimits(**limits), num_workers=workers
        )
        try:
            return await collector.collect(flow, tasks, n, mode="train")
        finally:
            collector.close()

    return asyncio.run(run())


@agent_flow
async def two_turns(task, ctx):
    """Two chat turns (the second continues the first); records the process it ran in."""
    messages = list(MESSAGES)
    reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Again?"},
    ]
    reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    return Episode(trajectories=[Trajectory(name="two_turns")], answer=reply.choices[0].message.content,
                   metrics={"pid": float(os.getpid())})  # fmt: skip


def _tokens(episodes: list[Episode]) -> list[tuple]:
    return [
        (e.id, e.termination_reason, [(s.prompt_ids, s.response_ids) for s in e.trajectories[0].steps])
        for e in episodes
    ]


def _logprobs(episodes: list[Episode]) -> list[float]:
    return [lp for e in episodes for s in e.trajectories[0].steps for lp in s.logprobs]


def test_flows_in_workers_give_the_episodes_the_trainers_process_gives(stack):  # noqa: F811
    tasks = [Task(id=f"t{i}") for i in range(3)]
    here = collect(stack, two_turns, tasks, n=2, workers=0)
    there = collect(stack, two_turns, tasks, n=2, workers=2)
    # Session ids, and with them the sampling seeds, are the same: the engine draws the same tokens.
    assert _tokens(there) == _tokens(here)
    # Batched with other rows in other orders, float32 logprobs may differ in their last bits only.
    assert _logprobs(there) == pytest.approx(_logprobs(here), abs=1e-4)
    assert all(len(e.trajectories[0].steps) == 2 for e in there)  # both turns traced, in the trainer
    ran_in = {int(e.metrics["pid"]) for e in there}
    assert os.getpid() not in ran_in and {int(e.metrics["pid"]) for e in here} == {os.getpid()}
    assert len(ran_in) == 2  # least-loaded routing spread 6 concurrent rollouts over both workers


def test_a_flow_that_blocks_its_event_loop_blocks_only_its_worker(stack):  # noqa: F811
    @agent_flow
    async def blocking_tool(task, ctx):
        time.sleep(0.5)  # a synchronous tool: it holds the event loop it runs on
        return "done"

    async def timed(workers: int) -> float:
        collector = RolloutCollector(stack.backend, stack.model_name, CollectorLimits(), num_workers=workers)
        try:
            started = time.perf_counter()
            episodes = await collector.collect(blocking_tool, [Task(id=f"t{i}") for i in range(4)], 1)
            assert [e.termination_reason for e in episodes] == [TerminationReason.ENV_DONE] * 4
            return time.perf_counter() - started
        finally:
            collector.close()

    assert asyncio.run(timed(0)) >= 2.0  # one event loop: the four tools run one after another
    assert asyncio.run(timed(4)) < 1.5  # a loop each: together


def test_a_failure_in_a_worker_is_classified_as_in_the_trainers_process(stack):  # noqa: F811
    @agent_flow
    async def fails(task, ctx):
        if task.id == "raises":
            await ctx.client.chat.completions.create(model=ctx.model, messages=MESSAGES)
            raise RuntimeError("tool crashed in the worker")
        for _ in range(5):  # past agent.max_steps=2: the gateway refuses the third call
            await ctx.client.chat.completions.create(model=ctx.model, messages=MESSAGES)
        return "never"

    episodes = {
        e.task_id: e for e in collect(stack, fails, [Task(id="raises"), Task(id="loops")], max_steps=2)
    }
    raised = episodes["raises"]
    assert raised.termination_reason == TerminationReason.ERROR
    assert "RuntimeError('tool crashed in the worker')" in raised.error and "in fails" in raised.error
    assert len(raised.trajectories[0].steps) == 1  # its call before the crash is still traced
    looped = episodes["loops"]
    assert looped.termination_reason == TerminationReason.MAX_TURNS_EXCEEDED and looped.error is None
    assert looped.metrics["num_model_calls"] == 2.0


def test_a_hung_rollout_times_out_and_is_cancelled_in_its_worker(stack, tmp_path):  # noqa: F811
    marker = tmp_path / "cancelled"

    @agent_flow
    async def hangs(task, ctx):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            marker.write_text(str(os.getpid()))  # the worker got the collector's cancel
            raise
        return "never"

    started = time.perf_counter()
    [episode] = collect(stack, hangs, [Task(id="hang")], workers=1, timeout=1.0)
    assert time.perf_counter() - started < 15.0
    assert episode.termination_reason == TerminationReason.TIMEOUT and "agent.timeout=1.0" in episode.error
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists() and int(marker.read_text()) != os.getpid()


def test_a_worker_that_dies_costs_its_rollout_and_is_started_again(stack):  # noqa: F811
    @agent_flow
    async def dies(task, ctx):
        if task.id == "dies":
            os._exit(3)
        return str(os.getpid())

    async def run():
        collector = RolloutCollector(stack.backend, stack.model_name, CollectorLimits(), num_workers=1)
        try:
            first = await collector.collect(dies, [Task(id="dies")], 1)
            pid_before = collector.workers.pids()
            second = await collector.collect(dies, [Task(id="lives")], 1)
            return first, second, pid_before, collector.workers.pids()
        finally:
            collector.close()

    [died], [lived], pid_before, pid_after = asyncio.run(run())
    assert died.termination_reason == TerminationReason.ERROR
    assert "exited with code 3 during the rollout" in died.error
    assert lived.termination_reason == TerminationReason.ENV_DONE and int(lived.answer) == pid_after[0]
    assert pid_after != pid_before


def test_a_flow_that_cannot_be_pickled_fails_its_rollouts_naming_the_setting(stack):  # noqa: F811
    lock = threading.Lock()

    @agent_flow
    async def holds_a_lock(task, ctx):
        with lock:
            return "unreachable"

    [episode] = collect(stack, holds_a_lock, [Task(id="t")], workers=1)
    assert episode.termination_reason == TerminationReason.ERROR
    assert "cannot be pickled" in episode.error and "agent.num_workers=0" in episode.error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) counts as gone
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "loop",
    [[], ["async_training.enable=true", "async_training.staleness_threshold=1"]],
    ids=["sync", "async"],
)
def test_a_training_run_runs_its_flows_in_workers_and_leaves_none_behind(tmp_path, loop):
    from agentrl import AgentTrainer, MathAnswerMatch
    from tests.integration.training._short_run import short_run_overrides

    ran_in = tmp_path / "pids"
    ran_in.mkdir()

    @agent_flow
    async def answers(task, ctx):
        (ran_in / str(os.getpid())).touch()
        reply = await ctx.client.chat.completions.create(model=ctx.model, messages=task["prompt"])
        return reply.choices[0].message.content

    config = short_run_overrides(tmp_path / "run", "agent.num_workers=2", "agent.group_calls=false", *loop)
    result = AgentTrainer(flow=answers, evaluator=MathAnswerMatch(), config=config).train()
    assert result.global_step == 1
    pids = [int(p.name) for p in ran_in.iterdir()]
    assert pids and os.getpid() not in pids  # every rollout ran in a worker
    assert not any(_alive(pid) for pid in pids)  # and the run stopped its workers


def test_a_negative_num_workers_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="agent.num_workers"):
        load_config(["agent.num_workers=-1"])
