"""The pool calls an embedded server of its own process as Python (`server.DirectCalls`): the answers, the
refusals and the failover are the ones HTTP gives, and the HTTP route is not used."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.rollout._openai_protocol import FINAL_BODY_FIELD, LOGPROB_VALUES_FIELD
from agentrl.rollout.app import DirectCalls, build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "What is 2 + 3?"}],
    "max_tokens": 6,
    "temperature": 1.0,
    "seed": 7,
    "logprobs": True,
    "return_token_ids": True,
}


@pytest.fixture
def served(model, tokenizer, monkeypatch):
    """A running server, and the list of paths its direct calls answered."""
    engine = EmbeddedEngine(model, tokenizer, max_num_seqs=8, max_model_len=128)
    handle = start_server_in_thread(build_server_app(engine, tokenizer, model_name="tiny"))
    answered: list[str] = []
    original = DirectCalls.call

    async def recording(self, path, body):
        answer = await original(self, path, body)
        if answer is not None:
            answered.append(path)
        return answer

    original_stream = DirectCalls.stream

    async def recording_stream(self, path, body):
        answered.append(f"stream {path}")
        return await original_stream(self, path, body)

    monkeypatch.setattr(DirectCalls, "call", recording)
    monkeypatch.setattr(DirectCalls, "stream", recording_stream)
    yield handle, engine, answered
    handle.stop()
    engine.close()


def _forward(url: str, path: str, body: dict, *, in_process: bool):
    async def run():
        pool = RolloutPool([url], model_name="tiny", in_process=in_process, max_retries=0)
        try:
            return await pool.forward("s", path, body)
        finally:
            await pool.aclose()

    return asyncio.run(run())


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": [10, 11, 12], "max_tokens": 5, "seed": 3, "logprobs": 1},
        ),
    ],
    ids=["chat", "completions"],
)
def test_a_direct_call_answers_what_http_answers(served, path, body):
    handle, _, answered = served
    direct = _forward(handle.url, path, body, in_process=True)
    assert answered == [path]
    over_tcp = _forward(handle.url, path, body, in_process=False)
    assert answered == [path]  # the TCP call did not go through the direct path
    assert direct.status == over_tcp.status == 200
    assert _without_ids(direct.body) == _without_ids(over_tcp.body)


@pytest.mark.parametrize(
    ("path", "asked", "plain"),
    [
        ("/v1/chat/completions", {"logprobs": True}, {"logprobs": False}),
        ("/v1/completions", {"logprobs": 0}, {"logprobs": None}),
    ],
    ids=["chat", "completions"],
)
def test_logprob_values_are_the_entries_logprobs_without_the_entries(served, path, asked, plain):
    """The gateway's `agentrl_logprob_values`: the same sampled logprobs as floats, and no per-token entries
    unless `logprobs` is asked too."""
    handle, _, _ = served
    base = {**CHAT, "max_tokens": 6, "ignore_eos": True}
    if path == "/v1/completions":
        base = {"model": "tiny", "prompt": [10, 11, 12], "max_tokens": 6, "seed": 3, "ignore_eos": True}
    with_entries = _forward(handle.url, path, {**base, **asked}, in_process=True).body["choices"][0]
    values_only = _forward(handle.url, path, {**base, **plain, LOGPROB_VALUES_FIELD: True}, in_process=True)
    choice = values_only.body["choices"][0]
    entries = with_entries["logprobs"]
    expected = (
        [e["logprob"] for e in entries["content"]] if "content" in entries else entries["token_logprobs"]
    )
    assert choice["logprobs"] is None
    assert len(choice[LOGPROB_VALUES_FIELD]) == 6
    assert choice[LOGPROB_VALUES_FIELD] == expected
    assert LOGPROB_VALUES_FIELD not in with_entries


def test_refusals_are_the_same_status_and_message_as_over_http(served):
    handle, _, answered = served
    for bad in ({**CHAT, "temperature": "hot"}, {**CHAT, "messages": []}, {**CHAT, "n": 99}):
        direct = _forward(handle.url, "/v1/chat/completions", bad, in_process=True)
        over_tcp = _forward(handle.url, "/v1/chat/completions", bad, in_process=False)
        assert direct.status == over_tcp.status and 400 <= direct.status < 500
        assert direct.body == over_tcp.body
    assert len(answered) == 3


def test_forward_of_a_streaming_request_is_refused_as_over_http(served):
    handle, _, answered = served
    # `forward` parses JSON answers; a stream is not one, which is the HTTP path's answer too (a ValueError).
    answer = _forward(handle.url, "/v1/chat/completions", {**CHAT, "stream": True}, in_process=True)
    assert answered == [] and answer.status == 503


def _stream_events(url: str, path: str, body: dict, *, direct: bool, keep: int | None = None) -> list:
    """The events `forward_stream` hands over (all, or the first `keep` before the stream is closed)."""

    async def run():
        pool = RolloutPool([url], model_name="tiny", direct=direct, max_retries=0)
        try:
            stream = await pool.forward_stream("s", path, body)
            events = []
            try:
                async for event in stream.events():
                    events.append(event)
                    if keep is not None and len(events) == keep:
                        break
            finally:
                await stream.aclose()
            return events, pool.servers[0].in_flight
        finally:
            await pool.aclose()

    return asyncio.run(run())


def _comparable(event):
    """An event without the ids and times each call draws anew (also inside the final body)."""
    if isinstance(event, dict) and FINAL_BODY_FIELD in event:
        return {FINAL_BODY_FIELD: _without_ids(event[FINAL_BODY_FIELD])}
    return _without_ids(event) if isinstance(event, dict) else event


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_a_streamed_answer_as_python_is_the_http_streams_events(served, path):
    handle, _, answered = served
    body = {**CHAT, "max_tokens": 8, "ignore_eos": True, "stream": True, FINAL_BODY_FIELD: True}
    if path == "/v1/completions":
        body = {k: v for k, v in body.items() if k not in ("messages", "logprobs")} | {"prompt": [5, 6, 7]}
    direct, direct_left = _stream_events(handle.url, path, body, direct=True)
    assert answered == [f"stream {path}"]
    over_http, http_left = _stream_events(handle.url, path, body, direct=False)
    assert answered == [f"stream {path}"]  # the second went over HTTP
    assert direct_left == http_left == 0  # each stream gave its server slot back
    assert len(direct) >= 8  # a chunk per token, then the final body
    assert [_comparable(e) for e in direct] == [_comparable(e) for e in over_http]
    final = direct[-1][FINAL_BODY_FIELD]
    assert len(final["choices"][0]["token_ids"]) == 8


def test_closing_a_python_stream_stops_its_generation(served):
    handle, engine, _ = served
    body = {**CHAT, "max_tokens": 100, "ignore_eos": True, "stream": True, FINAL_BODY_FIELD: True}
    events, left = _stream_events(handle.url, "/v1/chat/completions", body, direct=True, keep=3)
    assert len(events) == 3 and left == 0
    deadline = time.monotonic() + 10
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0  # the engine dropped the request, not ran it out


def test_an_engine_that_raises_marks_the_server_unhealthy_as_a_500_would(served, monkeypatch, caplog):
    handle, engine, _ = served

    async def broken(*_args, **_kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "generate", broken)
    answer = _forward(handle.url, "/v1/chat/completions", CHAT, in_process=True)
    assert answer.status == 503
    assert "HTTP 500" in answer.body["error"]["message"] and "device lost" in answer.body["error"]["message"]
    assert "in-process server" in caplog.text
