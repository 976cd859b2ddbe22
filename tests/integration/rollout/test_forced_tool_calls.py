"""Forced tool calls and JSON output against `agentrl serve` (embedded engine), as agent frameworks send them.

One `agentrl serve --model tiny:qwen2` for the module; the official `openai` client, the openai-agents
SDK and LangChain talk to it through the gateway, and every check reads the gateway's traces: the forced
call's tokens spell the chat template's own rendering of the call (then `<|im_end|>`), and their logprobs
are the raw policy's (a teacher-forced pass of the unmasked model), not the masked distribution's.
Token for token they may differ from the template's tokenization: the mask allows every token that
spells the grammar's text ("P" + "aris" as well as "Par" + "is"), as vLLM's guided decoding does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from test_serve import _admin, _interrupt, _start_serve  # the same start-up as the serve tests

from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.chat import render_chat

pytestmark = pytest.mark.slow
MODEL = "tiny:qwen2"
EOS = 2
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD_ARGS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": ADD_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}
USER = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def base():
    proc, url, lines = _start_serve(["--model", MODEL, "--max-tokens", "96", "--max-model-len", "512"], 180)
    _ADMIN[url] = _admin(lines)
    yield url
    out = _interrupt(proc)
    assert proc.returncode == 0, out


@pytest.fixture(scope="module")
def policy():
    return load_causal_lm(MODEL).eval(), load_tokenizer(MODEL)


def _client(base: str, session: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/sessions/{session}/v1", api_key="unused", max_retries=0, timeout=120
    )


_ADMIN: dict[str, dict[str, str]] = {}
"""Gateway URL -> the admin header its traces need (the token from the file `agentrl serve` printed)."""


def _traces(base: str, session: str) -> list[dict]:
    return httpx.get(f"{base}/sessions/{session}/traces", headers=_ADMIN[base], timeout=30).json()


def _teacher_forced_logprobs(policy, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    model, _ = policy
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion_ids).unsqueeze(1)).squeeze(1)


def _check_trace_is_the_rendered_call(
    policy, trace: dict, tool_calls: list[dict], messages: list[dict]
) -> None:
    """The trace's completion spells the template's rendering of the returned calls (then EOS), and its
    logprobs are the unmasked policy's."""
    _, tokenizer = policy
    assistant = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    full = render_chat(tokenizer, [*messages, assistant], tools=TOOLS, add_generation_prompt=False)
    prompt = trace["prompt_ids"]
    assert full[: len(prompt)] == prompt
    rendered = full[len(prompt) :]
    assert tokenizer.decode(trace["response_ids"]) == tokenizer.decode(rendered[: rendered.index(EOS) + 1])
    assert trace["response_ids"][0] == 3 and trace["response_ids"][-1] == EOS  # <tool_call> ... <|im_end|>
    expected = _teacher_forced_logprobs(policy, prompt, trace["response_ids"])
    got = torch.tensor(trace["logprobs"])
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # `<tool_call>` was the only token the mask allowed first: a masked logprob would be 0, the raw one is not.
    assert trace["logprobs"][0] < -1.0


def test_openai_client_named_tool_choice_gives_a_valid_call_for_every_seed(base, policy):
    for seed in range(5):
        session = f"named-{seed}"
        reply = _client(base, session).chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
        (trace,) = _traces(base, session)
        assert trace["finish_reason"] == "tool_calls"
        _check_trace_is_the_rendered_call(policy, trace, [call.model_dump()], USER)


def test_openai_client_required_gives_valid_calls_of_listed_tools(base, policy):
    names = set()
    for seed in range(6):
        session = f"required-{seed}"
        reply = _client(base, session).chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
        _check_trace_is_the_rendered_call(policy, _traces(base, session)[0], [call.model_dump()], USER)
    assert names == {"get_weather", "add"}  # `required` lets the policy choose the tool
    reply = _client(base, "required-parallel").chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", seed=1, max_tokens=96
    )
    if reply.choices[0].finish_reason == "tool_calls":  # several calls may not fit in 96 tokens
        for call in reply.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_forced_call_arrives_as_tool_call_deltas(base):
    chunks = list(
        _client(base, "stream").chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, stream=True, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )  # fmt: skip
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_ARGS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_response_format_json_schema_and_json_object(base, policy):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "result", "schema": schema, "strict": True}}
    for seed in range(4):
        session = f"json-{seed}"
        reply = _client(base, session).chat.completions.create(
            model=MODEL, messages=USER, response_format=fmt, seed=seed
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        (trace,) = _traces(base, session)
        expected = _teacher_forced_logprobs(policy, trace["prompt_ids"], trace["response_ids"])
        assert torch.allclose(torch.tensor(trace["logprobs"]), expected, atol=1e-4)
    reply = _client(base, "json-object").chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, seed=0, max_tokens=24
    )
    text = reply.choices[0].message.content
    assert text.startswith("{")  # an open object: a random policy rarely closes it in 24 tokens
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError) as info:
        _client(base, "json-bad").chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        )
    assert info.value.body["param"] == "response_format"


def _check_round_trip_traces(tokenizer, traces: list[dict]) -> None:
    """First call: the forced call; second: the answer, whose prompt continues the first call's text
    with the tool result (token for token too when the policy drew the template's tokenization)."""
    first, second = traces[0], traces[1]
    assert first["response_ids"][0] == 3 and 4 in first["response_ids"]  # <tool_call> ... </tool_call>
    assert first["response_ids"][-1] == EOS
    before = tokenizer.decode(first["prompt_ids"] + first["response_ids"])
    after = tokenizer.decode(second["prompt_ids"])
    assert after.startswith(before) and "<tool_response>\nsunny in " in after[len(before) :]


def test_openai_agents_sdk_forced_tool_round_trip(base, policy):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no export of the SDK's own traces (no network here)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    async def run(tool_choice: str, session: str):
        client = openai.AsyncOpenAI(base_url=f"{base}/sessions/{session}/v1", api_key="unused", max_retries=0)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        # `required` with one call: this random policy prefers another "\n<tool_call>" to EOS.
        parallel = False if tool_choice == "required" else None
        # The seed goes in `extra_args`: ModelSettings has no `seed` field and drops unknown keywords silently,
        # which left this test unseeded (a random answer, now and then an empty one) until the 23rd session.
        settings = ModelSettings(
            tool_choice=tool_choice, max_tokens=48, parallel_tool_calls=parallel, extra_args={"seed": 7}
        )
        agent = Agent(
            name="weather", instructions="Answer.", tools=[get_weather], model=model, model_settings=settings
        )
        result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
        await client.close()
        return result

    for tool_choice, session in (("get_weather", "agents-named"), ("required", "agents-required")):
        seen.clear()
        result = asyncio.run(run(tool_choice, session))
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
        assert seen and seen[0] in ("Paris", "Lima")
        assert isinstance(result.final_output, str)
        traces = _traces(base, session)
        assert traces[0]["finish_reason"] == "tool_calls" and len(traces) >= 2
        _check_round_trip_traces(policy[1], traces)


def test_langchain_forced_tool_round_trip(base, policy):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    for tool_choice, session in (("get_weather", "lc-named"), ("any", "lc-any")):
        llm = ChatOpenAI(
            model=MODEL, base_url=f"{base}/sessions/{session}/v1", api_key="unused", max_tokens=48, seed=5,
            max_retries=0,
        )  # fmt: skip
        human = HumanMessage("Weather in Lima?")
        # `any` (`required`) with one call: this random policy prefers another "\n<tool_call>" to EOS.
        single = {"parallel_tool_calls": False} if tool_choice == "any" else {}
        ai = llm.bind_tools([get_weather], tool_choice=tool_choice, **single).invoke([human])
        (call,) = ai.tool_calls
        assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Lima")
        tool_message = get_weather.invoke(call)
        assert tool_message.content == f"sunny in {call['args']['city']}"
        answer = llm.bind_tools([get_weather]).invoke([human, ai, tool_message])
        assert isinstance(answer.content, str)
        _check_round_trip_traces(policy[1], _traces(base, session))
