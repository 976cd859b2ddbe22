"""The collector against a real rollout stack: embedded engine + server, gateway, trace store.

Every failure of a flow becomes an episode with its termination reason; steps carry the exact token ids and
logprobs the engine produced, and assembly turns them into rows.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from agentrl import AgentFlow, Episode, Step, Task, TerminationReason, Trajectory, agent_flow
from agentrl.config import load_config
from agentrl.flow import SingleTurnChatFlow
from agentrl.models import load_tokenizer, resolve_model_path
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from agentrl.rollout.serving.embedded import start_embedded_serving
from agentrl.rollout.stack import RolloutStack
from agentrl.training.update.assembly import episodes_to_rows, rows_to_batch
from agentrl.training.update.forward import compute_log_probs

pytestmark = pytest.mark.slow

MAX_RESPONSE = 6
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def stack():
    config = load_config(
        [
            "actor_rollout_ref.model.path=tiny:qwen2-mini",
            f"data.max_response_length={MAX_RESPONSE}",
            "agent.timeout=30",
        ]
    )
    path = resolve_model_path(config.actor_rollout_ref.model.path)
    tokenizer = load_tokenizer(path)
    rollout = start_embedded_serving(path, tokenizer, config, device="cpu")
    stack = RolloutStack([rollout.url], config, tokenizer.pad_token_id)
    stack.rollout, stack.tokenizer = rollout, tokenizer
    try:
        asyncio.run(_collect(stack, _chat_once, [Task(id="warmup")], n=4))  # the first calls pay the warm-up
        yield stack
    finally:
        stack.shutdown()
        rollout.stop()


async def _collect(stack, flow: AgentFlow, tasks, n: int = 1, **limits) -> list[Episode]:
    collector = RolloutCollector(stack.backend, stack.model_name, CollectorLimits(**limits))
    return await collector.collect(flow, tasks, n, mode="train")


def collect(stack, flow, tasks, n=1, **limits) -> list[Episode]:
    return asyncio.run(_collect(stack, flow, tasks, n, **limits))


def assert_engine_logprobs_equal_teacher_forcing(stack, episodes: list[Episode]) -> None:
    """The rollout logprobs are the policy's own (temperature 1): a teacher-forced pass agrees."""
    rows, _ = episodes_to_rows(episodes)
    batch = rows_to_batch(rows, pad_token_id=stack.tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = compute_log_probs(stack.rollout.engine.model, batch)
    mask = batch.response_mask
    assert torch.allclose(recomputed[mask], batch.rollout_log_probs[mask], atol=1e-4)


@agent_flow
async def _chat_once(task, ctx):
    reply = await ctx.client.chat.completions.create(model=ctx.model, messages=MESSAGES)
    return reply.choices[0].message.content


def _by_task(episodes: list[Episode]) -> dict[str, list[Episode]]:
    out: dict[str, list[Episode]] = {}
    for episode in episodes:
        out.setdefault(episode.task_id, []).append(episode)
    return out


def test_a_raising_flow_is_an_error_episode_and_the_others_are_fine(stack):
    @agent_flow
    async def flaky(task, ctx):
        answer = await _chat_once.run(task, ctx)
        if task.id == "bad":
            raise RuntimeError("tool crashed on purpose")
        return answer

    episodes = _by_task(collect(stack, flaky, [Task(id="good"), Task(id="bad")], n=2))
    for bad in episodes["bad"]:
        assert bad.termination_reason == TerminationReason.ERROR
        assert "RuntimeError('tool crashed on purpose')" in bad.error
        assert "Traceback" in bad.error and "in flaky" in bad.error
    for good in episodes["good"]:
        assert good.termination_reason != TerminationReason.ERROR and good.error is None
        assert good.answer and len(good.trajectories[0].steps) == 1
    assert sorted(e.id for e in episodes["bad"]) == ["bad:0", "bad:1"]


def test_a_hanging_flow_times_out_and_collect_returns_quickly(stack):
    @agent_flow
    async def sometimes_hangs(task, ctx):
        if task.id == "hang":
            await asyncio.sleep(60)
        return "done"  # no model call: on a loaded machine a first call can take close to a second

    started = time.perf_counter()
    episodes = _by_task(collect(stack, sometimes_hangs, [Task(id="hang"), Task(id="ok")], n=2, timeout=1.0))
    elapsed = time.perf_counter() - started

    assert elapsed < 5.0
    for hung in episodes["hang"]:
        assert hung.termination_reason == TerminationReason.TIMEOUT
        assert "agent.timeout=1.0" in hung.error
    assert [e.termination_reason for e in episodes["ok"]] == [TerminationReason.ENV_DONE] * 2


def test_a_timeout_error_raised_by_the_flow_itself_is_an_error_not_an_agent_timeout(stack):
    @agent_flow
    async def tool_times_out(task, ctx):
        await _chat_once.run(task, ctx)
        await asyncio.wait_for(asyncio.sleep(10), timeout=0.01)  # a tool call with its own deadline

    [episode] = collect(stack, tool_times_out, [Task(id="t")], timeout=30.0)
    assert episode.termination_reason == TerminationReason.ERROR  # dropped from training, not kept as timeout
    assert "TimeoutError" in episode.error and "in tool_times_out" in episode.error


def test_a_flow_returning_the_wrong_type_is_an_error_naming_it(stack):
    @agent_flow
    async def returns_int(task, ctx):
        await _chat_once.run(task, ctx)
        return 42

    [episode] = collect(stack, returns_int, [Task(id="t")])
    assert episode.termination_reason == TerminationReason.ERROR
    assert "returned int" in episode.error and "Trajectory" in episode.error


def _calls(count: int) -> AgentFlow:
    @agent_flow
    async def calls(task, ctx):
        for _ in range(count):
            answer = await _chat_once.run(task, ctx)
        return answer

    return calls


def test_more_model_calls_than_max_steps_is_max_turns_exceeded(stack):
    [over] = collect(stack, _calls(50), [Task(id="t")], max_steps=2)
    [within] = collect(stack, _calls(2), [Task(id="t")], max_steps=2)
    # The gateway refuses the third call, so a looping agent stops at once instead of running to the timeout.
    assert over.termination_reason == TerminationReason.MAX_TURNS_EXCEEDED
    assert over.metrics["num_model_calls"] == 2.0
    assert over.error is None and len(over.trajectories[0].steps) == 2
    assert within.termination_reason != TerminationReason.MAX_TURNS_EXCEEDED


def test_a_flow_that_swallows_the_refusal_is_still_max_turns_exceeded(stack):
    @agent_flow
    async def swallows(task, ctx):
        for _ in range(5):
            try:
                await _chat_once.run(task, ctx)
            except openai.BadRequestError:
                return "gave up"
        return "never"

    [episode] = collect(stack, swallows, [Task(id="t")], max_steps=1)
    assert episode.termination_reason == TerminationReason.MAX_TURNS_EXCEEDED
    assert episode.answer == "gave up"


def test_a_completion_cut_by_max_tokens_is_max_response_length_exceeded(stack):
    @agent_flow
    async def no_model(task, ctx):
        return "done"

    episodes = collect(stack, _chat_once, [Task(id="t")], n=4)
    cut = [e for e in episodes if e.trajectories[0].steps[-1].finish_reason == "length"]
    assert cut, "the tiny model should hit the 6-token cap"
    for episode in cut:
        assert episode.termination_reason == TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
        assert len(episode.trajectories[0].steps[-1].response_ids) == MAX_RESPONSE
    [plain] = collect(stack, no_model, [Task(id="t")])
    assert plain.termination_reason == TerminationReason.ENV_DONE


def test_a_prompt_over_max_prompt_length_is_flagged(stack):
    [episode] = collect(stack, _chat_once, [Task(id="t")], max_prompt_length=5)
    assert episode.termination_reason == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED


FILLER = "Check each digit of that sum again and explain the carry, step by step, in plain words. " * 3


def _growing_history(stop_cleanly: bool) -> AgentFlow:
    """A multi-turn chat that adds a long user turn after every reply until the gateway refuses the prompt."""

    @agent_flow
    async def grows(task, ctx):
        messages = list(MESSAGES)
        for _ in range(30):
            try:
                reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.BadRequestError as exc:
                if stop_cleanly and exc.code == "max_prompt_length_exceeded":
                    return "stopped at the prompt limit"
                raise
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": FILLER},
            ]
        return "never refused"

    return grows


@pytest.mark.parametrize("stop_cleanly", [False, True], ids=["raises", "catches-the-code"])
def test_a_history_outgrowing_max_prompt_length_ends_as_such_and_keeps_its_turns(stack, stop_cleanly):
    """The gateway refuses the call (400, code max_prompt_length_exceeded: data.max_prompt_length is 256 here)
    before the engine generates; the episode keeps its earlier turns, whether the flow raises or stops."""
    limit = stack.backend.app.state.max_prompt_tokens
    assert limit == 256
    [episode] = collect(
        stack, _growing_history(stop_cleanly), [Task(id="t")], max_steps=30, max_prompt_length=limit
    )
    assert episode.termination_reason == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED
    assert episode.error is None
    steps = episode.trajectories[0].steps
    assert len(steps) >= 2 and episode.metrics["num_model_calls"] == len(steps)
    assert all(len(s.prompt_ids) <= limit and s.response_ids for s in steps)
    assert episode.answer == ("stopped at the prompt limit" if stop_cleanly else None)
    rows, _ = episodes_to_rows([episode])
    assert rows and all(any(r.response_mask) for r in rows)


def test_a_step_claiming_text_the_model_never_produced_is_counted_and_excluded(stack):
    @agent_flow
    async def claims(task, ctx):
        real = await _chat_once.run(task, ctx)
        await _chat_once.run(task, ctx)  # a second call whose text the flow misreports
        return Trajectory(
            steps=[
                Step(model_response=real, reward=0.5),
                Step(model_response="I never said this", reward=0.5),
            ]
        )

    [episode] = collect(stack, claims, [Task(id="t")])
    assert episode.termination_reason != TerminationReason.ERROR
    assert episode.metrics["trace_mismatch"] == 1.0
    matched, invented = episode.trajectories[0].steps
    assert matched.response_ids and matched.reward == 0.5 and "excluded" not in matched.info
    assert invented.info["excluded"] == "trace_mismatch" and not invented.response_ids
    rows, stats = episodes_to_rows([episode])
    assert len(rows) == 1 and stats.excluded_steps == 1
    assert rows[0].input_ids == matched.prompt_ids + matched.response_ids


def test_steps_carry_the_gateway_token_ids_and_logprobs(stack):
    seen: dict[str, dict] = {}

    @agent_flow
    async def records(task, ctx):
        reply = await ctx.client.chat.completions.create(
            model=ctx.model, messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        seen[task.id] = {
            "prompt": reply.prompt_token_ids,
            "completion": choice.token_ids,
            "logprobs": [c.logprob for c in choice.logprobs.content],
        }
        return choice.message.content

    episodes = collect(stack, records, [Task(id="a"), Task(id="b")])
    for episode in episodes:
        [step] = episode.trajectories[0].steps
        answer = seen[episode.task_id]
        assert step.prompt_ids == answer["prompt"]
        assert step.response_ids == answer["completion"] and len(step.response_ids) > 0
        assert step.logprobs == answer["logprobs"]
        assert step.model_response == episode.answer
        assert step.prompt_ids == stack.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    assert_engine_logprobs_equal_teacher_forcing(stack, episodes)


def test_a_two_turn_token_flow_merges_into_one_row_with_mask_on_model_tokens(stack):
    observation = stack.tokenizer.encode("\nobservation: 5\n")

    @agent_flow
    async def two_turns(task, ctx):
        prompt = stack.tokenizer.encode("Q: 2 + 3 =")
        first = await ctx.client.completions.create(
            model=ctx.model, prompt=prompt, extra_body={"return_token_ids": True}
        )
        # The second call's prompt is the first prompt, the first reply's exact tokens and an observation.
        prompt = prompt + first.choices[0].token_ids + observation
        second = await ctx.client.completions.create(model=ctx.model, prompt=prompt)
        return Trajectory(
            steps=[Step(model_response=first.choices[0].text), Step(model_response=second.choices[0].text)]
        )

    [episode] = collect(stack, two_turns, [Task(id="t")])
    first, second = episode.trajectories[0].steps
    assert episode.metrics["trace_mismatch"] == 0.0
    assert second.prompt_ids == first.prompt_ids + first.response_ids + observation
    rows, stats = episodes_to_rows([episode])
    assert len(rows) == 1 and stats.merged_steps == 1
    [row] = rows
    assert row.input_ids == second.prompt_ids + second.response_ids
    assert row.response_mask == (
        [0] * len(first.prompt_ids)
        + [1] * len(first.response_ids)
        + [0] * len(observation)
        + [1] * len(second.response_ids)
    )
    assert row.rollout_log_probs == (
        [0.0] * len(first.prompt_ids) + first.logprobs + [0.0] * len(observation) + second.logprobs
    )


def test_a_two_turn_chat_merges_when_the_history_re_renders_to_the_same_tokens(stack):
    """Chat history is re-rendered from text; a random model's stray UTF-8 bytes may not survive that
    round trip. A turn that extends the previous one merges; one that does not becomes its own row."""

    @agent_flow
    async def two_turns(task, ctx):
        seed = int(task.id.split("-")[1])
        messages = list(MESSAGES)
        first = await ctx.client.chat.completions.create(model=ctx.model, messages=messages, seed=seed)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Are you sure?"},
        ]
        second = await ctx.client.chat.completions.create(model=ctx.model, messages=messages, seed=seed)
        return second.choices[0].message.content

    episodes = collect(stack, two_turns, [Task(id=f"seed-{i}") for i in range(8)])
    merged = 0
    for episode in episodes:
        first, second = episode.trajectories[0].steps
        rows, stats = episodes_to_rows([episode])
        context = first.prompt_ids + first.response_ids
        if second.prompt_ids[: len(context)] != context:
            assert len(rows) == 2 and stats.merged_steps == 0
            assert [r.input_ids for r in rows] == [context, second.prompt_ids + second.response_ids]
            continue
        merged += 1
        [row] = rows
        observation = len(second.prompt_ids) - len(context)
        assert row.input_ids == second.prompt_ids + second.response_ids
        assert row.response_mask == (
            [0] * len(first.prompt_ids)
            + [1] * len(first.response_ids)
            + [0] * observation
            + [1] * len(second.response_ids)
        )
        assert stats.merged_steps == 1
    assert merged >= 1, "no seeded two-turn chat extended its first turn"


def test_a_retryable_failure_is_tried_again_up_to_retry_limit(stack):
    attempts: list[str] = []

    @agent_flow
    async def flaky_connection(task, ctx):
        attempts.append(ctx.session_id)
        if len(attempts) == 1:  # the first attempt loses its connection to the server
            await ctx.client.with_options(base_url="http://127.0.0.1:9/v1").chat.completions.create(
                model=ctx.model, messages=MESSAGES
            )
        return await _chat_once.run(task, ctx)

    [episode] = collect(stack, flaky_connection, [Task(id="t")], retry_limit=2)
    assert episode.termination_reason != TerminationReason.ERROR and episode.error is None
    assert episode.metrics["retries"] == 1.0
    assert len(set(attempts)) == 2  # each attempt in a fresh session
    assert len(episode.trajectories[0].steps) == 1  # only the successful attempt's call

    attempts.clear()
    [episode] = collect(stack, flaky_connection, [Task(id="t")], retry_limit=1)
    assert episode.termination_reason == TerminationReason.ERROR and "APIConnectionError" in episode.error
    assert len(attempts) == 1


def test_flows_call_the_model_on_the_fast_request_path_and_other_code_does_not(stack):
    """The collector runs each flow inside `fast_transform()` (openai's walk of plain bodies skipped); code
    outside a flow keeps openai's behaviour."""
    from agentrl.rollout import client_transform

    seen: list[bool] = []

    @agent_flow
    async def probe(task, ctx):
        seen.append(client_transform._ACTIVE.get())
        return await _chat_once.run(task, ctx)

    episodes = collect(stack, probe, [Task(id="t")], n=2)
    assert seen == [True, True]
    assert all(e.error is None for e in episodes)
    assert all(e.trajectories and e.trajectories[0].steps for e in episodes)
    assert client_transform._ACTIVE.get() is False


class _CountingExecutor(ThreadPoolExecutor):
    """The event loop's default executor, counting what is sent to its threads."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_a_flows_model_calls_stay_on_the_event_loop(stack):
    """A fresh openai client asks for its platform in a worker thread at its first request; the collector's
    clients already know it, so rollouts make no thread hop (one per rollout before, on the loop that also runs
    the gateway and the server). The same first call from a plain client does hop: the count sees it."""

    async def counted(run) -> int:
        executor = _CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        await run()
        return executor.submitted

    async def collect_four() -> None:
        episodes = await _collect(stack, _chat_once, [Task(id="t")], n=4)
        assert all(e.error is None and e.trajectories[0].steps for e in episodes)

    async def plain_client_call() -> None:
        url = stack.backend.open_session("plain", "train", max_calls=1)
        try:
            client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
            await client.chat.completions.create(model=stack.model_name, messages=MESSAGES)
            await client.close()
        finally:
            stack.backend.close_session("plain")

    assert asyncio.run(counted(collect_four)) == 0
    assert asyncio.run(counted(plain_client_call)) >= 1


def _request_ids(episodes: list[Episode]) -> list[str]:
    return [s.info["request_id"] for e in episodes for t in e.trajectories for s in t.steps]


def test_a_single_call_flow_samples_a_tasks_group_in_one_call_with_exact_tokens(stack):
    """SingleTurnChatFlow defines run_group: a task's 4 rollouts are the 4 choices of one request, each its own
    episode with its own tokens, and the engine's logprobs still equal a teacher-forced pass. With
    group_calls=False the same flow makes 4 requests."""
    tasks = [Task(id="a", data={"prompt": MESSAGES}), Task(id="b", data={"prompt": MESSAGES})]
    episodes = collect(stack, SingleTurnChatFlow(), tasks, n=4)
    assert [e.id for e in episodes] == [f"{t}:{i}" for t in "ab" for i in range(4)]
    assert all(e.error is None and e.termination_reason is not TerminationReason.ERROR for e in episodes)
    ids = _request_ids(episodes)
    assert len(ids) == 8 and len(set(ids[:4])) == 1 and len(set(ids[4:])) == 1 and ids[0] != ids[4]
    for episode in episodes:
        [step] = episode.trajectories[0].steps
        assert step.model_response == episode.answer and len(step.response_ids) > 0
        assert episode.metrics["num_model_calls"] == 1.0
    assert len({tuple(e.trajectories[0].steps[0].response_ids) for e in episodes}) > 2  # choices differ

    assert_engine_logprobs_equal_teacher_forcing(stack, episodes)

    one_by_one = collect(stack, SingleTurnChatFlow(), tasks[:1], n=4, group_calls=False)
    assert len(set(_request_ids(one_by_one))) == 4


def test_a_subclass_that_overrides_run_only_is_not_grouped(stack):
    """An inherited run_group would skip the subclass's own run: the collector calls run n times instead."""
    calls: list[str] = []

    class Shouting(SingleTurnChatFlow):
        async def run(self, task, ctx):
            calls.append(task.id)
            return (await super().run(task, ctx)).upper()

    episodes = collect(stack, Shouting(), [Task(id="a", data={"prompt": MESSAGES})], n=3)
    assert calls == ["a", "a", "a"]
    assert len(set(_request_ids(episodes))) == 3
    assert all(e.answer == e.answer.upper() for e in episodes)


def test_a_group_that_cannot_be_split_fails_each_of_its_episodes_naming_why(stack):
    """run_group returning the wrong number of results, or raising, costs the task's n episodes, not the run."""

    class Short(SingleTurnChatFlow):
        async def run_group(self, task, ctx, n):
            return (await super().run_group(task, ctx, n))[:-1]

    class Raising(SingleTurnChatFlow):
        async def run_group(self, task, ctx, n):
            raise RuntimeError("tool down")

    tasks = [Task(id="a", data={"prompt": MESSAGES})]
    short = collect(stack, Short(), tasks, n=3)
    assert [e.termination_reason for e in short] == [TerminationReason.ERROR] * 3
    assert all("run_group returned a list of 2; expected a list of n=3" in e.error for e in short)
    raising = collect(stack, Raising(), tasks, n=3)
    assert [e.id for e in raising] == ["a:0", "a:1", "a:2"]
    assert all(e.termination_reason is TerminationReason.ERROR and "tool down" in e.error for e in raising)
