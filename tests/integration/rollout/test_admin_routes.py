"""Admin routes of a real embedded server and gateway on loopback: 401 without the token, 403 with a wrong one,
the process's own clients carry it; a sleeping engine says so on /health and answers a bounded 503."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import pytest

from agentrl.rollout.admin_auth import ADMIN_TOKEN_ENV, admin_headers, process_admin_token
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SERVER_ADMIN = [
    ("/update_weights", {"path": "/nonexistent"}),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}),
    ("/sleep", None),
    ("/wake_up", None),
]


@pytest.fixture
def served(model, tokenizer, monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=128)
    app = build_server_app(engine, tokenizer, model_name="tiny", sleep_wait_s=0.5)
    with start_server_in_thread(app) as handle:
        yield engine, handle.url
    engine.close()


def test_every_admin_route_of_the_server_needs_the_token_on_loopback(served):
    engine, url = served
    for path, body in SERVER_ADMIN:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, r.text)
        r = httpx.post(url + path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError", (path, r.text)
    assert not engine.is_sleeping and engine.policy_version == 0  # nothing happened
    # The right token: the process's own, which the server took by default.
    admin = admin_headers(process_admin_token())
    assert (
        httpx.post(url + "/update_weights", json={"path": "/nonexistent"}, headers=admin).status_code == 400
    )
    assert httpx.post(url + "/sleep", headers=admin).json() == {"is_sleeping": True}
    assert httpx.post(url + "/wake_up", headers=admin).json() == {"is_sleeping": False}
    # Model calls, health, stats and metrics need no token.
    assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert all(
        httpx.get(url + p).status_code == 200 for p in ("/health", "/is_sleeping", "/stats", "/metrics")
    )


def test_the_pool_of_this_process_carries_the_token_by_itself(served):
    engine, url = served
    pool = RolloutPool([url], model_name="tiny", in_process=False)  # over TCP: the header, not ASGI, counts
    asyncio.run(pool.sleep())
    assert engine.is_sleeping and pool.servers[0].healthy
    asyncio.run(pool.wake_up())
    assert not engine.is_sleeping
    stranger = RolloutPool([url], model_name="tiny", in_process=False, admin_token="not-the-token")
    asyncio.run(stranger.sleep())
    assert not engine.is_sleeping and "HTTP 403" in stranger.servers[0].last_error


def test_a_sleeping_engine_says_so_and_answers_within_the_bound(served):
    engine, url = served
    admin = admin_headers(process_admin_token())
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    httpx.post(url + "/sleep", headers=admin).raise_for_status()
    assert httpx.get(url + "/health").json() == {"status": "sleeping"}
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ):
        started = time.monotonic()
        r = httpx.post(url + path, json=body, timeout=30)
        waited = time.monotonic() - started
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "engine_sleeping", r.text
        assert "asleep" in error["message"] and "/wake_up" in error["message"]
        assert 0.5 <= waited < 5, waited  # waited for the wake-up, then answered (sleep_wait_s=0.5)
    # A request that arrives asleep and sees the engine wake within the bound is served.
    threading.Timer(0.2, lambda: httpx.post(url + "/wake_up", headers=admin)).start()
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200 and httpx.get(url + "/health").json() == {"status": "ok"}


def test_gateway_admin_routes_need_the_token_on_loopback(served, monkeypatch):
    _, url = served
    with Gateway(
        RolloutPool([url], model_name="tiny"), sampling_train=SamplingParams(max_tokens=2)
    ) as gateway:
        assert gateway.admin_token == process_admin_token()
        base = gateway.url
        assert base.startswith("http://127.0.0.1:")
        routes = [("POST", "/sessions", {"session_id": "s"}), ("GET", "/sessions/s/traces", None),
                  ("DELETE", "/sessions/s", None)]  # fmt: skip
        for method, path, body in routes:
            assert httpx.request(method, base + path, json=body).status_code == 401
            wrong = {"Authorization": "Bearer wrong"}
            assert httpx.request(method, base + path, json=body, headers=wrong).status_code == 403
        admin = admin_headers(gateway.admin_token)
        assert httpx.post(base + "/sessions", json={"session_id": "s"}, headers=admin).status_code == 200
        r = httpx.post(base + "/sessions/s/v1/chat/completions", json={"messages": CHAT["messages"]})
        assert r.status_code == 200  # a session's model calls need no token
        assert len(httpx.get(base + "/sessions/s/traces", headers=admin).json()) == 1
        # The trainer's path: sessions and traces in-process, no token to pass.
        gateway.open_session("t")
        assert gateway.session_traces("t") == []
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "shared-by-env")
    with Gateway(
        RolloutPool([url], model_name="tiny"), sampling_train=SamplingParams(max_tokens=2)
    ) as gateway:
        assert gateway.admin_token == "shared-by-env"
