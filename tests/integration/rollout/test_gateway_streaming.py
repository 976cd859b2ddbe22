"""Tokens stream through the gateway as they are generated, and the trace is the unstreamed call's.

A real embedded server on loopback behind the gateway, driven by the `openai` client. The server runs in this
process, so the pool takes its events as Python (`DirectCalls.stream`); every test runs again with the pool
told to stream over HTTP (`direct=False`), the path of a server in another process.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from agentrl.models import resolve_model_path
from agentrl.rollout._openai_protocol import FINAL_BODY_FIELD
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import build_embedded_engine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import InProcessFirstTransport, start_server_in_thread
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "tiny:qwen2"
MAX_TOKENS = 64
MAX_PROMPT = 300
MSG = [{"role": "user", "content": "Count from one to ten."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"which": {"type": "string", "enum": ["first", "second"]}},
                "required": ["which"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server():
    engine = build_embedded_engine(resolve_model_path(MODEL), max_model_len=512, max_num_seqs=8)
    handle = start_server_in_thread(
        build_server_app(engine, engine.tokenizer, model_name=MODEL, max_model_len=512)
    )
    yield handle
    handle.stop()
    engine.close()


@pytest.fixture(scope="module", params=[True, False], ids=["direct", "http"])
def gateway(server, request):
    pool = RolloutPool([server], model_name=MODEL, request_timeout=60, direct=request.param)
    sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    with Gateway(pool, sampling_train=sampling, max_prompt_tokens=MAX_PROMPT) as gw:
        yield gw


def _client(gateway: Gateway, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.open_session(sid), api_key="x", max_retries=0, timeout=60)


def _read(stream) -> tuple[str, list, list[float]]:
    """(the text, every chunk, when each arrived)."""
    chunks, times = [], []
    for chunk in stream:
        chunks.append(chunk)
        times.append(time.perf_counter())
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks, times


def test_tokens_arrive_while_the_answer_is_generated(gateway: Gateway) -> None:
    client = _client(gateway, "ttft")
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, stream=True, max_tokens=MAX_TOKENS, seed=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    _, chunks, times = _read(stream)
    with_tokens = [
        t
        for c, t in zip(chunks, times, strict=True)
        if c.choices and c.choices[0].model_extra.get("token_ids")
    ]
    (trace,) = gateway.session_traces("ttft")
    assert len(trace.response_ids) == MAX_TOKENS
    assert len(with_tokens) >= 8, f"{len(with_tokens)} chunks carried tokens: the answer came in one piece"
    first, total = with_tokens[0] - t0, times[-1] - t0
    assert first < total / 2, f"first tokens after {first:.3f}s of {total:.3f}s"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_streamed_call_is_traced_as_the_unstreamed_one(gateway: Gateway, chat: bool) -> None:
    texts, traces = {}, {}
    for stream in (False, True):
        sid = f"same-{chat}-{stream}"
        client = _client(gateway, sid)
        kwargs = {
            "model": MODEL,
            "stream": stream,
            "seed": 7,
            "max_tokens": 16,
            "extra_body": {"ignore_eos": True},
        }
        if chat:
            answer = client.chat.completions.create(messages=MSG, **kwargs)
            texts[stream] = _read(answer)[0] if stream else answer.choices[0].message.content
        else:
            answer = client.completions.create(prompt="one two three", **kwargs)
            texts[stream] = (
                "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
            )
        (traces[stream],) = gateway.session_traces(sid)
    plain, streamed = traces[False], traces[True]
    assert (streamed.prompt_ids, streamed.response_ids) == (plain.prompt_ids, plain.response_ids)
    assert streamed.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    assert (streamed.finish_reason, len(streamed.response_ids)) == ("length", 16)
    assert texts[True] == texts[False] == streamed.completion_text == plain.completion_text


def test_streamed_turns_continue_in_token_space(gateway: Gateway) -> None:
    client = _client(gateway, "turns")
    before = gateway.session_turns.continued
    messages = list(MSG)
    for turn in range(2):
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=12)
        text = _read(stream)[0]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({turn})."}]
    first, second = gateway.session_traces("turns")
    assert gateway.session_turns.continued == before + 1
    held = first.prompt_ids + first.response_ids
    assert second.prompt_ids[: len(held)] == held


def test_an_error_before_the_first_chunk_is_the_unstreamed_error(gateway: Gateway) -> None:
    long = [{"role": "user", "content": "word " * (2 * MAX_PROMPT)}]
    url = gateway.open_session("long") + "/chat/completions"
    plain = httpx.post(url, json={"model": MODEL, "messages": long}, timeout=60)
    streamed = httpx.post(url, json={"model": MODEL, "messages": long, "stream": True}, timeout=60)
    assert plain.status_code == streamed.status_code == 400
    assert streamed.json() == plain.json() and plain.json()["error"]["code"] == "max_prompt_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        _client(gateway, "long-client").chat.completions.create(model=MODEL, messages=long, stream=True)
    assert caught.value.code == "max_prompt_length_exceeded"
    assert gateway.session_traces("long") == [] and gateway.refused_prompts("long") == 2


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(gateway: Gateway) -> None:
    client = _client(gateway, "tools")
    forced = {"type": "function", "function": {"name": "add"}}
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, tool_choice=forced, stream=True, seed=3, max_tokens=MAX_TOKENS
    )
    _, chunks, _ = _read(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    (trace,) = gateway.session_traces("tools")
    assert trace.tool_calls[0]["function"]["name"] == "add"
    assert json.loads(trace.tool_calls[0]["function"]["arguments"]) == arguments


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_servers_final_body_is_its_unstreamed_answer(server, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 16, "seed": 5, "ignore_eos": True, "return_token_ids": True,
            "logprobs": True if chat else 2, **({"messages": MSG} if chat else {"prompt": "one two"})}  # fmt: skip
    plain = httpx.post(server.url + path, json=body, timeout=60).json()
    with httpx.stream("POST", server.url + path, json={**body, "stream": True, FINAL_BODY_FIELD: True}) as r:
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])[FINAL_BODY_FIELD]
    assert json.loads(events[0]).get("id") == final["id"]  # the chunks' id
    assert {**final, "id": None, "created": None} == {**plain, "id": None, "created": None}
    assert not any(FINAL_BODY_FIELD in json.loads(e) for e in events[:-2])


def test_a_client_that_leaves_mid_stream_frees_the_server_and_records_nothing(gateway: Gateway) -> None:
    client = _client(gateway, "gone")
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, stream=True, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while gateway.pool.servers[0].in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.pool.servers[0].in_flight == 0 and gateway.pool.servers[0].healthy
    assert gateway.session_traces("gone") == []


def test_a_flow_of_this_process_gets_its_tokens_as_they_come_and_can_leave(gateway: Gateway) -> None:
    """The trainer's flows reach its gateway through ASGI in their own event loop (`InProcessFirstTransport`), not
    TCP: their streams come part by part there too (httpx's own ASGI transport gave the whole answer at its
    end), and a flow that stops reading frees the server."""

    async def go() -> tuple[int, float, float]:
        http = httpx.AsyncClient(transport=InProcessFirstTransport(httpx.AsyncHTTPTransport()), timeout=60)
        async with http:

            def client(sid: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(
                    base_url=gateway.open_session(sid), api_key="x", max_retries=0, http_client=http
                )

            t0 = time.perf_counter()
            stream = await client("inproc").chat.completions.create(
                model=MODEL, messages=MSG, stream=True, max_tokens=MAX_TOKENS, seed=1,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            with_tokens, last = [], 0.0
            async for chunk in stream:
                last = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
                    with_tokens.append(last)
            gone = await client("inproc-gone").chat.completions.create(
                model=MODEL, messages=MSG, stream=True, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
            )
            await anext(aiter(gone))
            await gone.close()
            deadline = time.monotonic() + 30
            while gateway.pool.servers[0].in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return len(with_tokens), with_tokens[0], last

    chunks, first, total = asyncio.run(go())
    assert chunks >= 8, f"{chunks} chunks carried tokens: the answer came in one piece"
    assert first < total / 2, f"first tokens after {first:.3f}s of {total:.3f}s"
    assert gateway.pool.servers[0].in_flight == 0 and gateway.pool.servers[0].healthy
    assert gateway.session_traces("inproc-gone") == []
    (trace,) = gateway.session_traces("inproc")
    assert len(trace.response_ids) == MAX_TOKENS
