"""Gateway pieces: sampling enforcement, trace extraction, stripping, SSE replay, sessions, TraceStore.

The HTTP tests put the gateway in front of a small in-process server that answers like vLLM 0.32
(`prompt_token_ids` top-level for chat, per choice for completions; `choices[i].token_ids`).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rollout._openai_protocol import LOGPROB_VALUES_FIELD, PROMPT_LIMIT_CODE, build_error
from agentrl.rollout.admin_auth import admin_headers
from agentrl.rollout.gateway import (
    TURN_LIMIT_CODE,
    _ChatBody,
    _CompletionBody,
    build_gateway_app,
    build_upstream_body,
    derive_call_seed,
    extract_traces,
    is_prompt_too_long,
    refusal_reason,
)
from agentrl.rollout.gateway_stream import replay_stream, strip_response
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.traces import TraceStore, UnknownSessionError
from agentrl.types import SamplingParams, TerminationReason, Trace

TRAIN = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_tokens=16, stop=["</answer>"], seed=7)
MSG = [{"role": "user", "content": "hi"}]


def _chat_response() -> dict:
    lp = {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.25}]}
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": lp,
                     "finish_reason": "length", "token_ids": [10, 11]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }  # fmt: skip


def test_upstream_body_enforces_the_modes_sampling() -> None:
    raw = {"messages": MSG, "temperature": 0.0, "top_p": 0.1, "max_completion_tokens": 500, "stop": "\n",
           "stream": True, "stream_options": {"include_usage": True}, "model": "gpt-4", "n": 2}  # fmt: skip
    body = build_upstream_body(raw, _ChatBody.model_validate(raw), TRAIN, "served", chat=True)
    assert body == {
        "messages": MSG, "model": "served", "n": 2, "stream": False, "temperature": 0.9, "top_p": 0.8,
        "top_k": 20, "max_tokens": 16, "stop": ["\n", "</answer>"], "stop_token_ids": [],
        "return_token_ids": True, "logprobs": True,
    }  # fmt: skip
    raw = {"prompt": "x", "max_tokens": 3, "seed": 1, "logprobs": 2}
    body = build_upstream_body(raw, _CompletionBody.model_validate(raw), TRAIN, "served", chat=False)
    assert (body["max_tokens"], body["seed"], body["logprobs"]) == (
        3,
        1,
        2,
    )  # client's smaller cap and seed kept
    raw = {"prompt": [1, 2]}
    body = build_upstream_body(raw, _CompletionBody.model_validate(raw), TRAIN, "served", chat=False)
    assert (body["max_tokens"], body["logprobs"]) == (16, 1)


def test_an_embedded_server_is_asked_for_logprob_values_and_entries_only_when_the_client_asked() -> None:
    for raw, chat, entries in (
        ({"messages": MSG}, True, False),
        ({"messages": MSG, "logprobs": True}, True, True),
        ({"prompt": [1, 2]}, False, None),
        ({"prompt": [1, 2], "logprobs": 2}, False, 2),
    ):
        model = _ChatBody if chat else _CompletionBody
        body = build_upstream_body(
            raw, model.model_validate(raw), TRAIN, "served", chat=chat, logprob_values=True
        )
        assert body[LOGPROB_VALUES_FIELD] is True and body["logprobs"] == entries, raw
    # the field is the gateway's to set: a client's is dropped on the way to a vLLM server
    raw = {"messages": MSG, LOGPROB_VALUES_FIELD: True}
    body = build_upstream_body(raw, _ChatBody.model_validate(raw), TRAIN, "served", chat=True)
    assert LOGPROB_VALUES_FIELD not in body and body["logprobs"] is True


def test_call_seeds_are_reproducible_and_distinct_per_session_and_call() -> None:
    assert derive_call_seed(7, "train0-t.0.a0", 1) == derive_call_seed(7, "train0-t.0.a0", 1)
    seeds = {derive_call_seed(7, f"train0-t.{i}.a0", c) for i in range(8) for c in range(1, 4)}
    assert len(seeds) == 24  # the n samples of a task must not share a seed
    assert derive_call_seed(8, "train0-t.0.a0", 1) != derive_call_seed(7, "train0-t.0.a0", 1)


def test_extract_traces_reads_vllm_fields_and_checks_lengths() -> None:
    (t,) = extract_traces(_chat_response(), "s", chat=True, messages=MSG)
    assert (t.prompt_ids, t.response_ids, t.logprobs) == ([1, 2, 3], [10, 11], [-0.5, -1.25])
    assert (t.finish_reason, t.completion_text, t.request_id, t.messages) == (
        "length",
        "ab",
        "chatcmpl-1",
        MSG,
    )
    comp = {"id": "c", "choices": [
        {"index": 0, "text": "x", "prompt_token_ids": [4], "token_ids": [5], "finish_reason": "stop",
         "logprobs": {"token_logprobs": [-0.1], "tokens": ["x"]}},
        {"index": 1, "text": "yz", "prompt_token_ids": [4], "token_ids": [6, 7], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-0.2, -0.3], "tokens": ["y", "z"]}}]}  # fmt: skip
    traces = extract_traces(comp, "s", chat=False)
    assert [(t.choice_index, t.response_ids, t.logprobs) for t in traces] == [
        (0, [5], [-0.1]), (1, [6, 7], [-0.2, -0.3])]  # fmt: skip
    bad = _chat_response()
    del bad["prompt_token_ids"]
    with pytest.raises(ValueError, match="lacks prompt_token_ids"):
        extract_traces(bad, "s", chat=True)
    bad = _chat_response()
    bad["choices"][0]["token_ids"] = [10]
    with pytest.raises(ValueError, match="1 token ids but 2 logprobs"):
        extract_traces(bad, "s", chat=True)


def test_strip_response_removes_what_the_client_did_not_ask_for() -> None:
    plain = strip_response(_chat_response(), _ChatBody.model_validate({"messages": MSG}), chat=True)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None
    asked = _ChatBody.model_validate({"messages": MSG, "logprobs": True, "return_token_ids": True})
    assert strip_response(_chat_response(), asked, chat=True) == _chat_response()


def test_replay_stream_emits_openai_chunks() -> None:
    req = _ChatBody.model_validate(
        {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
    )
    body = strip_response(_chat_response(), req, chat=True)
    events = list(replay_stream(body, req, chat=True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "ab"},
        {},
    ]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 2
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)


@pytest.fixture
def gateway_client():
    upstream = FastAPI()
    seen: list[dict] = []

    @upstream.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        seen.append(await request.json())
        return _chat_response()

    pool = RolloutPool(["http://srv"], model_name="m", transport=httpx.ASGITransport(upstream))
    store = TraceStore()
    app = build_gateway_app(pool, store, sampling_train=TRAIN, max_n=2)
    return app, store, seen


def _call(app, method: str, url: str, **kw) -> httpx.Response:
    """A call as the trainer's own clients make it: with the app's admin token (model calls ignore it)."""
    kw.setdefault("headers", admin_headers(app.state.admin_token))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            return await c.request(method, url, **kw)

    return asyncio.run(go())


def test_sessions_must_be_opened_and_modes_switch_sampling(gateway_client) -> None:
    app, store, seen = gateway_client
    r = _call(app, "POST", "/sessions/nope/v1/chat/completions", json={"messages": MSG})
    assert r.status_code == 404 and "unknown session 'nope'" in r.json()["error"]["message"]
    sid = _call(app, "POST", "/sessions", json={"mode": "val"}).json()["session_id"]
    assert store.mode(sid) == "validation"
    r = _call(app, "POST", f"/sessions/{sid}/v1/chat/completions", json={"messages": MSG, "temperature": 1.5})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab"
    assert (seen[-1]["temperature"], seen[-1]["max_tokens"]) == (0.0, 16)  # validation: greedy, train's cap
    (trace,) = json.loads(_call(app, "GET", f"/sessions/{sid}/traces").text)
    assert Trace.model_validate(trace).server == "http://srv"
    r = _call(app, "POST", "/sessions", json={"session_id": "mine", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    assert (
        _call(app, "POST", "/sessions", json={"session_id": "mine"}).json()["base_url"] == "/sessions/mine/v1"
    )
    r = _call(app, "POST", "/sessions/mine/v1/chat/completions", json={"messages": MSG, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and len(seen) == 1


def test_implicit_sessions_open_on_first_use() -> None:
    pool = RolloutPool(["http://srv"], model_name="m")
    store = TraceStore()
    app = build_gateway_app(pool, store, sampling_train=TRAIN, allow_implicit_sessions=True)
    assert _call(app, "GET", "/sessions/fresh/v1/models").json()["data"][0]["id"] == "m"
    assert store.mode("fresh") == "train"


def test_trace_store_is_per_session_and_thread_safe() -> None:
    store = TraceStore()
    sid = store.open_session()
    store.open_session("b", "validation")

    def add(n: int) -> None:
        for i in range(200):
            store.add(Trace(session_id=sid, request_id=f"{n}-{i}", prompt_ids=[1], completion_ids=[2],
                            logprobs=[-1.0], finish_reason="stop"))  # fmt: skip

    threads = [threading.Thread(target=add, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.traces(sid)) == 800 and store.traces("b") == []
    assert sorted(store.session_ids()) == sorted([sid, "b"])
    store.clear(sid)
    assert store.traces(sid) == [] and store.has_session(sid)
    store.close_session(sid)
    with pytest.raises(UnknownSessionError, match="unknown session"):
        store.traces(sid)
    with pytest.raises(ValueError, match="mode must be one of"):
        store.open_session("c", "greedy")
    with pytest.raises(ValueError, match="without '/'"):
        store.open_session("a/b")


def test_upstream_body_passes_vllm_extensions_under_vllms_names() -> None:
    raw = {"messages": MSG, "max_tokens": 500, "min_tokens": 400, "ignore_eos": True}
    body = build_upstream_body(raw, _ChatBody.model_validate(raw), TRAIN, "served", chat=True)
    assert (body["ignore_eos"], body["min_tokens"], body["max_tokens"]) == (True, 16, 16)  # within the cap
    raw = {"messages": MSG}
    fixed = TRAIN.model_copy(update={"ignore_eos": True, "min_tokens": 16})  # a mode that fixes lengths
    body = build_upstream_body(raw, _ChatBody.model_validate(raw), fixed, "served", chat=True)
    assert (body["ignore_eos"], body["min_tokens"]) == (True, 16)
    body = build_upstream_body(raw, _ChatBody.model_validate(raw), TRAIN, "served", chat=True)
    assert "ignore_eos" not in body and "min_tokens" not in body


def test_refused_requests_name_the_field(gateway_client) -> None:
    app, _, seen = gateway_client
    sid = _call(app, "POST", "/sessions", json={}).json()["session_id"]
    url = f"/sessions/{sid}/v1/chat/completions"
    r = _call(app, "POST", url, json={"messages": MSG, "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "`gpt-4o` does not exist" in r.json()["error"]["message"]
    tool_turn = [*MSG, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "4"}]
    r = _call(app, "POST", url, json={"messages": tool_turn, "model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.tool_call_id"
    r = _call(app, "POST", url, json={"messages": MSG, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = _call(app, "POST", url, json={"messages": MSG, "ignore_eos": "yes please"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
    assert seen == []  # nothing reached the server
    r = _call(app, "POST", url, json={"messages": MSG, "model": "m", "min_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and (seen[-1]["min_tokens"], seen[-1]["ignore_eos"]) == (3, True)


VLLM_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 256 tokens. However, your prompt contains 300 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=300)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}  # vLLM 0.32's answer (renderers/params.py `_token_len_check`)


def _limited_gateway(answer, *, engine: str = "embedded", max_prompt_tokens: int | None = 4):
    """A gateway with `max_prompt_tokens` in front of a server that answers `answer(body) -> (status, body)`."""
    upstream = FastAPI()
    seen: list[dict] = []

    @upstream.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        seen.append(await request.json())
        status, body = answer(seen[-1])
        return JSONResponse(body, status_code=status)

    pool = RolloutPool(["http://srv"], model_name="m", engine=engine, transport=httpx.ASGITransport(upstream))
    store = TraceStore()
    app = build_gateway_app(pool, store, sampling_train=TRAIN, max_prompt_tokens=max_prompt_tokens)
    return app, store, seen


def _embedded_answer(body: dict) -> tuple[int, dict]:
    """Like the embedded server: refuses a prompt over `agentrl_max_prompt_tokens` (3 tokens here)."""
    limit = body.get("agentrl_max_prompt_tokens")
    if limit is not None and limit < 3:
        message = f"messages: the prompt has 3 tokens, more than the {limit} allowed (data.max_prompt_length)"
        return 400, build_error(message, "messages", 400, PROMPT_LIMIT_CODE)
    return 200, _chat_response()


@pytest.mark.parametrize(
    ("engine", "answer", "limit"),
    [
        ("embedded", _embedded_answer, 2),  # the server refuses under the limit the gateway sends it
        ("vllm", lambda body: (400, VLLM_TOO_LONG), 1000),  # vLLM's own context-length refusal, mapped
        ("vllm", lambda body: (200, _chat_response()), 2),  # vLLM generated: refused after, no trace kept
    ],
    ids=["embedded", "vllm-context-length", "vllm-over-data.max_prompt_length"],
)
def test_a_prompt_over_the_limit_is_refused_with_its_code(engine, answer, limit) -> None:
    app, store, seen = _limited_gateway(answer, engine=engine, max_prompt_tokens=limit)
    sid = _call(app, "POST", "/sessions", json={}).json()["session_id"]
    body = {"messages": MSG, "agentrl_max_prompt_tokens": 10_000}  # a client's value is never forwarded
    r = _call(app, "POST", f"/sessions/{sid}/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "max_prompt_length_exceeded", r.text
    assert error["type"] == "BadRequestError" and error["param"] in ("messages", "input_tokens")
    assert seen[-1].get("agentrl_max_prompt_tokens") == (limit if engine == "embedded" else None)
    assert store.refused_prompts(sid) == 1 and store.traces(sid) == []
    assert refusal_reason(error["code"]) == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED


def test_a_prompt_within_the_limit_is_served_and_without_a_limit_nothing_is_sent() -> None:
    app, store, seen = _limited_gateway(_embedded_answer, max_prompt_tokens=3)
    sid = _call(app, "POST", "/sessions", json={}).json()["session_id"]
    r = _call(app, "POST", f"/sessions/{sid}/v1/chat/completions", json={"messages": MSG})
    assert r.status_code == 200 and seen[-1]["agentrl_max_prompt_tokens"] == 3
    assert len(store.traces(sid)) == 1 and store.refused_prompts(sid) == 0
    app, store, seen = _limited_gateway(_embedded_answer, max_prompt_tokens=None)  # `agentrl serve`
    sid = _call(app, "POST", "/sessions", json={}).json()["session_id"]
    body = {"messages": MSG, "agentrl_max_prompt_tokens": 1}
    assert _call(app, "POST", f"/sessions/{sid}/v1/chat/completions", json=body).status_code == 200
    assert "agentrl_max_prompt_tokens" not in seen[-1]


def test_refusal_codes_map_to_termination_reasons_and_nothing_else_does() -> None:
    assert refusal_reason(TURN_LIMIT_CODE) == TerminationReason.MAX_TURNS_EXCEEDED
    assert refusal_reason(PROMPT_LIMIT_CODE) == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED
    assert [refusal_reason(code) for code in (400, None, "invalid_value", ["x"])] == [None] * 4
    assert is_prompt_too_long(VLLM_TOO_LONG) and not is_prompt_too_long(
        {"error": {"param": "n", "code": 400}}
    )
    assert not is_prompt_too_long({"detail": "x"}) and not is_prompt_too_long(None)


def test_errors_are_typed_as_vllm_types_them_and_top_logprobs_needs_logprobs(gateway_client) -> None:
    app, _, seen = gateway_client
    r = _call(app, "POST", "/sessions/nope/v1/chat/completions", json={"messages": MSG})
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (
        404,
        "NotFoundError",
        404,
    )
    sid = _call(app, "POST", "/sessions", json={}).json()["session_id"]
    url = f"/sessions/{sid}/v1/chat/completions"
    r = _call(app, "POST", url, json={"messages": MSG, "n": 3})
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (
        400,
        "BadRequestError",
        400,
    )
    r = _call(app, "POST", url, content=b"{not json")
    assert r.json()["error"]["type"] == "BadRequestError"
    r = _call(app, "POST", url, json={"messages": MSG, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert "logprobs" in r.json()["error"]["message"] and seen == []
    r = _call(app, "POST", url, json={"messages": MSG, "logit_bias": "not a map"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = _call(app, "POST", url, json={"messages": MSG, "top_logprobs": 2, "logprobs": True})
    assert r.status_code == 200 and len(seen) == 1
