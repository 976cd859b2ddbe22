"""Two embedded servers behind the gateway, driven by the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from agentrl.models import resolve_model_path
from agentrl.rollout._openai_protocol import LOGPROB_VALUES_FIELD
from agentrl.rollout.admin_auth import admin_headers
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import build_embedded_engine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "tiny:qwen2-mini"
MAX_TOKENS = 6  # the train-mode cap the gateway enforces
MSG = [{"role": "user", "content": "What is 2 + 3?"}]


def _start_embedded_server(path: str):
    engine = build_embedded_engine(path, max_model_len=256, max_num_seqs=16)
    app = build_server_app(engine, engine.tokenizer, model_name=MODEL, max_model_len=256, max_n=8)
    return engine, start_server_in_thread(app)


@pytest.fixture(scope="module")
def stack():
    path = resolve_model_path(MODEL)
    started = [_start_embedded_server(path) for _ in range(2)]
    pool = RolloutPool([h for _, h in started], model_name=MODEL, request_timeout=60)
    gateway = Gateway(pool, sampling_train=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), max_n=4)
    with gateway:
        yield gateway
    for engine, handle in started:
        handle.stop()
        engine.close()


def _client(gateway: Gateway, mode: str = "train", sid: str | None = None) -> tuple[str, openai.OpenAI]:
    url = gateway.open_session(sid, mode)
    return url.split("/sessions/")[1].split("/")[0], openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def _check_trace(trace, gateway: Gateway) -> None:
    assert trace.prompt_ids and trace.response_ids
    assert len(trace.logprobs) == len(trace.response_ids) <= MAX_TOKENS
    assert all(lp <= 0.0 for lp in trace.logprobs)
    assert trace.server in {s.url for s in gateway.pool.servers}
    assert trace.latency_s > 0


def test_sync_chat_is_an_ordinary_response_and_is_traced(stack: Gateway) -> None:
    sid, client = _client(stack)
    reply = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.0, max_tokens=500)
    choice = reply.choices[0]
    assert choice.logprobs is None and reply.model == MODEL
    assert "token_ids" not in (choice.model_extra or {}) and "prompt_token_ids" not in (
        reply.model_extra or {}
    )
    assert LOGPROB_VALUES_FIELD not in (choice.model_extra or {})
    (trace,) = stack.session_traces(sid)
    _check_trace(trace, stack)
    assert trace.messages == MSG and trace.completion_text == choice.message.content
    assert trace.finish_reason == choice.finish_reason
    # Train mode enforces temperature 1.0 and the token cap, whatever the client asked for.
    assert reply.usage.completion_tokens == len(trace.response_ids) <= MAX_TOKENS


def test_token_ids_and_logprobs_when_the_client_asks(stack: Gateway) -> None:
    sid, client = _client(stack)
    reply = client.chat.completions.create(
        model=MODEL, messages=MSG, logprobs=True, extra_body={"return_token_ids": True}
    )
    (trace,) = stack.session_traces(sid)
    assert reply.model_extra["prompt_token_ids"] == trace.prompt_ids
    assert reply.choices[0].model_extra["token_ids"] == trace.response_ids
    assert [e.logprob for e in reply.choices[0].logprobs.content] == pytest.approx(trace.logprobs)


def test_the_trace_holds_the_same_logprobs_whether_or_not_the_client_asks(stack: Gateway) -> None:
    """Without the client's `logprobs` the server sends them as floats (no per-token entries): same values."""
    traces = []
    for asked in (True, False):
        sid, client = _client(stack)
        client.chat.completions.create(model=MODEL, messages=MSG, logprobs=asked, seed=11)
        (trace,) = stack.session_traces(sid)
        traces.append(trace)
    assert traces[0].response_ids == traces[1].response_ids
    assert traces[0].logprobs == pytest.approx(traces[1].logprobs, abs=1e-5)


def test_async_completions_n2_and_streaming(stack: Gateway) -> None:
    sid, _ = _client(stack)
    client = openai.AsyncOpenAI(base_url=stack.session_url(sid), api_key="x", max_retries=0)

    async def run():
        comp = await client.completions.create(model=MODEL, prompt="1 + 1 =", n=2)
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSG, stream=True, stream_options={"include_usage": True}
        )
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        cstream = await client.completions.create(model=MODEL, prompt="abc", stream=True)
        texts = [c.choices[0].text async for c in cstream if c.choices]
        return comp, "".join(pieces), usage, finish, "".join(texts)

    comp, streamed, usage, finish, ctext = asyncio.run(run())
    traces = stack.session_traces(sid)
    assert [t.choice_index for t in traces] == [0, 1, 0, 0]
    for t in traces:
        _check_trace(t, stack)
    assert [c.text for c in comp.choices] == [traces[0].completion_text, traces[1].completion_text]
    assert traces[0].messages is None and traces[0].prompt_ids == traces[1].prompt_ids
    assert streamed == traces[2].completion_text and finish == traces[2].finish_reason
    assert usage.completion_tokens == len(traces[2].response_ids)
    assert ctext == traces[3].completion_text


def test_validation_mode_is_greedy_whatever_the_client_sends(stack: Gateway) -> None:
    sid, client = _client(stack, mode="validation")
    outs = [
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.7, top_p=0.5).choices[0]
        for _ in range(3)
    ]
    ids = [t.response_ids for t in stack.session_traces(sid)]
    assert ids[0] == ids[1] == ids[2] and len({o.message.content for o in outs}) == 1


def test_tool_call_round_trip_messages_are_accepted(stack: Gateway) -> None:
    sid, client = _client(stack)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]  # fmt: skip
    client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    (trace,) = stack.session_traces(sid)
    assert trace.messages == messages and len(trace.prompt_ids) > 20


def test_session_sticks_to_its_server_and_sessions_spread(stack: Gateway) -> None:
    sids = []
    for _ in range(4):
        sid, client = _client(stack)
        sids.append(sid)
        for _ in range(2):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    servers = [{t.server for t in stack.session_traces(s)} for s in sids]
    assert all(len(s) == 1 for s in servers)
    assert set.union(*servers) == {s.url for s in stack.pool.servers}  # both servers got sessions


def test_32_concurrent_sessions_all_answered(stack: Gateway) -> None:
    async def one(i: int) -> int:
        url = stack.open_session(f"conc-{i}")
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model=MODEL, messages=MSG)
        return len(stack.session_traces(f"conc-{i}"))

    async def run():
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(run()) == [1] * 32


def test_unknown_session_is_404_and_bad_fields_are_4xx(stack: Gateway) -> None:
    base = stack.url
    r = httpx.post(f"{base}/sessions/nope/v1/chat/completions", json={"messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
    admin = admin_headers(stack.admin_token)
    assert httpx.get(f"{base}/sessions/nope/traces", headers=admin).status_code == 404
    sid = httpx.post(f"{base}/sessions", json={"mode": "validation"}, headers=admin).json()["session_id"]
    url = f"{base}/sessions/{sid}/v1"
    cases = {
        "n": {"messages": MSG, "n": 5},  # above the gateway's cap of 4
        "messages": {"messages": "hi"},
        "temperature": {"messages": MSG, "temperature": "hot"},
        "max_tokens": {"messages": MSG, "max_tokens": 0},
        "messages.1.tool_call_id": {"messages": [*MSG, {"role": "tool", "content": "5"}]},
        "min_tokens": {"messages": MSG, "max_tokens": 2, "min_tokens": 3},
    }
    for field, body in cases.items():
        r = httpx.post(f"{url}/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert f"'{field}'" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/chat/completions", json={"messages": MSG, "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai.OpenAI(base_url=url, api_key="x", max_retries=0).completions.create(model="gpt-4o", prompt="x")
    r = httpx.post(f"{url}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/completions", json={"prompt": "word " * 400})  # longer than max_model_len 256
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{base}/sessions", json={"mode": "greedy"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert httpx.get(f"{url}/models").json()["data"][0]["id"] == MODEL
    assert stack.session_traces(sid) == []  # refused calls leave no trace
    assert httpx.delete(f"{base}/sessions/{sid}", headers=admin).status_code == 200
    assert httpx.post(f"{url}/completions", json={"prompt": "x"}).status_code == 404


_SUBPROCESS_SERVER = """
import sys, threading
from agentrl.rollout.engines.embedded import build_embedded_engine
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.rollout.app import build_server_app
engine = build_embedded_engine(sys.argv[1], max_model_len=256)
handle = start_server_in_thread(build_server_app(engine, engine.tokenizer, model_name=sys.argv[2], max_model_len=256))
print(handle.url, flush=True)
threading.Event().wait()
"""


def test_killing_a_server_mid_run_leaves_every_request_answered(stack: Gateway) -> None:
    path = resolve_model_path(MODEL)
    proc = subprocess.Popen([sys.executable, "-c", _SUBPROCESS_SERVER, path, MODEL], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        victim_url = proc.stdout.readline().strip()
        assert victim_url.startswith("http://127.0.0.1:")
        engine, survivor = _start_embedded_server(path)
        pool = RolloutPool(
            [victim_url, survivor.url], model_name=MODEL, request_timeout=30, probe_interval=60
        )
        sampling = SamplingParams(max_tokens=160)  # long enough that requests are in flight at the kill
        with Gateway(pool, sampling_train=sampling) as gw:

            async def one(i: int) -> int:
                async with openai.AsyncOpenAI(
                    base_url=gw.open_session(f"k{i}"), api_key="x", max_retries=0
                ) as c:
                    await c.completions.create(model=MODEL, prompt=f"{i} apples and", max_tokens=160)
                return len(gw.session_traces(f"k{i}"))

            async def run():
                tasks = [asyncio.create_task(one(i)) for i in range(12)]
                while pool.servers[0].in_flight < 2:  # kill while the victim is generating
                    await asyncio.sleep(0.005)
                in_flight_at_kill.append(pool.servers[0].in_flight)
                proc.kill()  # SIGKILL: connections drop mid-generation
                return await asyncio.gather(*tasks)

            in_flight_at_kill: list[int] = []

            t0 = time.perf_counter()
            assert asyncio.run(run()) == [1] * 12
            victim = pool.servers[0]
            assert in_flight_at_kill[0] > 0 and not victim.healthy and victim.failures >= 1, victim
            traces = [t for i in range(12) for t in gw.session_traces(f"k{i}")]
            assert {t.server for t in traces} <= {victim_url, survivor.url}
            assert any(t.server == survivor.url for t in traces)
            assert time.perf_counter() - t0 < 120
        survivor.stop()
        engine.close()
    finally:
        proc.kill()
        proc.wait()


def test_hung_server_times_out_and_the_request_moves(stack: Gateway) -> None:
    hung = socket.socket()  # listens (the kernel accepts connections) but never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:
        healthy_url = stack.pool.servers[0].url
        pool = RolloutPool([f"http://127.0.0.1:{hung.getsockname()[1]}", healthy_url], model_name=MODEL,
                           request_timeout=1.0, probe_timeout=0.5, probe_interval=60)  # fmt: skip
        with Gateway(pool, sampling_train=SamplingParams(max_tokens=4)) as gw:
            client = openai.OpenAI(base_url=gw.open_session("h"), api_key="x", max_retries=0)
            t0 = time.perf_counter()
            client.completions.create(model=MODEL, prompt="hi")
            assert time.perf_counter() - t0 < 10
            (trace,) = gw.session_traces("h")
            assert trace.server == healthy_url
            assert not pool.servers[0].healthy and "Timeout" in pool.servers[0].last_error
            assert httpx.get(f"{gw.url}/health").json()["servers"][0]["healthy"] is False
    finally:
        hung.close()
