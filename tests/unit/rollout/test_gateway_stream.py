"""Streaming through the gateway: relayed chunks, the final body recorded and never forwarded, errors.

The server is a small FastAPI app that streams canned events as the embedded server does (reached through
httpx's ASGI transport: the events arrive together, which is all these tests need; the loopback tests in
tests/integration/rollout/test_gateway_streaming.py time real streams).
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentrl.rollout._openai_protocol import FINAL_BODY_FIELD, PROMPT_LIMIT_CODE, build_error
from agentrl.rollout._sse import dumps_sse
from agentrl.rollout.admin_auth import admin_headers
from agentrl.rollout.gateway import build_gateway_app
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.pool_stream import PoolStream
from agentrl.rollout.traces import TraceStore
from agentrl.types import SamplingParams

MSG = [{"role": "user", "content": "hi"}]
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _lp(*tokens: tuple[str, float]) -> dict:
    return {"content": [{"token": t, "logprob": lp} for t, lp in tokens]}


FINAL = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": [1, 2, 3],
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "length",
                 "logprobs": _lp(("a", -0.5), ("b", -1.25)), "token_ids": [10, 11]}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, "policy_version": 0,
    "agentrl_continued": True,
}  # fmt: skip
CHUNKS = [
    {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], "policy_version": 0, "prompt_token_ids": [1, 2, 3]},
    {**HEAD, "choices": [{"index": 0, "delta": {}, "logprobs": _lp(("a", -0.5)), "finish_reason": None,
                          "token_ids": [10]}]},  # text held back: nothing for a client that asked no ids
    {**HEAD, "choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": _lp(("b", -1.25)),
                          "finish_reason": "length", "token_ids": [11]}]},
]  # fmt: skip


def _gateway(events):
    """A gateway in front of a server streaming `events(body)` (a list of payloads, or (status, JSON))."""
    upstream = FastAPI()
    seen: list[dict] = []

    @upstream.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(await request.json())
        answer = events(seen[-1])
        if isinstance(answer, tuple):
            return JSONResponse(answer[1], status_code=answer[0])
        return StreamingResponse(iter([dumps_sse(e) for e in answer]), media_type="text/event-stream")

    pool = RolloutPool(["http://srv"], model_name="m", transport=httpx.ASGITransport(upstream))
    store = TraceStore()
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    return build_gateway_app(pool, store, sampling_train=sampling, max_prompt_tokens=8), store, seen


def _stream(app, body: dict) -> tuple[httpx.Response, list]:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            sid = (await c.post("/sessions", json={"session_id": "s"}, headers=admin)).json()["session_id"]
            return await c.post(f"/sessions/{sid}/v1/chat/completions", json=body)

    admin = admin_headers(app.state.admin_token)
    r = asyncio.run(go())
    if not r.headers["content-type"].startswith("text/event-stream"):
        return r, []
    data = [line[len("data: ") :] for line in r.text.split("\n\n") if line]
    return r, [d if d == "[DONE]" else json.loads(d) for d in data]


def test_chunks_are_relayed_stripped_and_the_final_body_is_recorded() -> None:
    app, store, seen = _gateway(lambda body: [*CHUNKS, {FINAL_BODY_FIELD: FINAL}, "[DONE]"])
    body = {"messages": MSG, "model": "m", "stream": True, "stream_options": {"include_usage": True}}
    r, events = _stream(app, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert seen[-1]["stream"] is True and seen[-1][FINAL_BODY_FIELD] is True
    assert "stream_options" not in seen[-1]  # the usage chunk is the gateway's, from the final body
    first, text, usage, done = events
    assert (
        first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        and "prompt_token_ids" not in first
    )
    assert text["choices"] == [
        {"index": 0, "delta": {"content": "ab"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == [] and usage["usage"] == FINAL["usage"] and usage["id"] == "chatcmpl-1"
    assert done == "[DONE]" and not any(FINAL_BODY_FIELD in e for e in events if isinstance(e, dict))
    (trace,) = store.traces("s")
    assert (trace.prompt_ids, trace.response_ids, trace.logprobs) == ([1, 2, 3], [10, 11], [-0.5, -1.25])
    assert trace.completion_text == "ab" and trace.request_id == "chatcmpl-1" and trace.messages == MSG


def test_what_the_client_asks_for_is_kept_and_the_model_is_its_name() -> None:
    app, _, _ = _gateway(lambda body: [*CHUNKS, {FINAL_BODY_FIELD: FINAL}, "[DONE]"])
    body = {"messages": MSG, "stream": True, "logprobs": True, "return_token_ids": True}
    _, events = _stream(app, body)
    assert len(events) == 4 and events[-1] == "[DONE]"  # no usage chunk unless asked
    assert [e["choices"][0] for e in events[:3]] == [c["choices"][0] for c in CHUNKS]
    assert events[0]["prompt_token_ids"] == [1, 2, 3]


def test_an_error_before_the_first_chunk_is_the_unstreamed_json_error() -> None:
    refusal = build_error(
        "messages: the prompt has 9 tokens, more than the 8 allowed", "messages", 400, PROMPT_LIMIT_CODE
    )
    app, store, seen = _gateway(lambda body: (400, refusal))
    r, _ = _stream(app, {"messages": MSG, "stream": True})
    assert r.status_code == 400 and r.json() == refusal
    assert store.refused_prompts("s") == 1 and store.traces("s") == []
    app, store, _ = _gateway(lambda body: (422, build_error("bad", "x", 422)))
    r, _ = _stream(app, {"messages": MSG, "stream": True})
    assert r.status_code == 422 and r.json()["error"]["param"] == "x" and store.traces("s") == []


def test_a_failure_mid_stream_ends_it_with_an_error_and_records_nothing() -> None:
    broken = build_error("generation failed: boom", None, 500)
    app, store, _ = _gateway(lambda body: [CHUNKS[0], broken, "[DONE]"])
    r, events = _stream(app, {"messages": MSG, "stream": True})
    assert r.status_code == 200 and events[1] == broken and events[-1] == "[DONE]"
    assert store.traces("s") == [] and not app.state.pool.servers[0].healthy
    app, store, _ = _gateway(lambda body: [*CHUNKS, "[DONE]"])  # a server that sent no final body
    _, events = _stream(app, {"messages": MSG, "stream": True})
    assert "without the final body" in events[-2]["error"]["message"] and store.traces("s") == []
    app, store, _ = _gateway(lambda body: CHUNKS)  # the connection ends before [DONE]
    _, events = _stream(app, {"messages": MSG, "stream": True})
    assert "stream broke" in events[-2]["error"]["message"] and store.traces("s") == []


def test_the_pool_fails_over_before_the_first_event_and_frees_its_slot() -> None:
    fleet = FastAPI()

    @fleet.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.url.hostname == "a":
            return JSONResponse(build_error("engine down", None, 500), status_code=500)
        return StreamingResponse(
            iter([dumps_sse(CHUNKS[0]), dumps_sse("[DONE]")]), media_type="text/event-stream"
        )

    pool = RolloutPool(["http://a", "http://b"], model_name="m", transport=httpx.ASGITransport(fleet))

    async def go() -> list:
        stream = await pool.forward_stream("s", "/v1/chat/completions", {"stream": True})
        assert isinstance(stream, PoolStream) and stream.server == "http://b"
        assert [s.in_flight for s in pool.servers] == [0, 1]
        events = [e async for e in stream.events()]
        await stream.aclose()
        await stream.aclose()  # once only
        return events

    assert asyncio.run(go()) == [CHUNKS[0]]
    assert [s.in_flight for s in pool.servers] == [0, 0] and not pool.servers[0].healthy
    assert pool.server_of("s") == "http://b"
