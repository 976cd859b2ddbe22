"""Admin routes: open on loopback, behind a bearer token off loopback (gateway app over ASGI, real HTTP)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from agentrl.rollout.admin_auth import ADMIN_TOKEN_ENV, is_loopback, resolve_admin_token
from agentrl.rollout.gateway import build_gateway_app
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.traces import TraceStore
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams

TRAIN = SamplingParams(max_tokens=8)
REMOTE = ("10.1.2.3", 40000)


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org", ""))


def test_token_is_given_from_env_or_made_off_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    assert resolve_admin_token("127.0.0.1") is None
    assert resolve_admin_token("127.0.0.1", "mine") == "mine"
    made = resolve_admin_token("0.0.0.0")
    assert made and len(made) >= 32 and made != resolve_admin_token("0.0.0.0")  # per run, random
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    assert resolve_admin_token("0.0.0.0") == resolve_admin_token("127.0.0.1") == "from-env"
    assert resolve_admin_token("0.0.0.0", "arg") == "arg"


def _app(token: str | None) -> FastAPI:
    pool = RolloutPool(["http://srv"], model_name="m")
    return build_gateway_app(pool, TraceStore(), sampling_train=TRAIN, admin_token=token)


def _call(app: FastAPI, method: str, url: str, client=("127.0.0.1", 1234), **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.request(method, url, **kw)

    return asyncio.run(go())


def test_gateway_session_routes_need_the_token_when_one_is_set() -> None:
    app = _app("s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = _call(app, "POST", "/sessions", json={"session_id": "a"}, headers=headers)
        assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"]
    ok = {"Authorization": "Bearer s3cret"}
    assert (
        _call(app, "POST", "/sessions", json={"session_id": "a"}, headers=ok, client=REMOTE).status_code
        == 200
    )
    assert _call(app, "GET", "/sessions/a/traces").status_code == 401
    assert _call(app, "DELETE", "/sessions/a").status_code == 401
    assert _call(app, "GET", "/sessions/a/traces", headers=ok).json() == []
    # Model calls and health are not admin routes.
    assert _call(app, "GET", "/sessions/a/v1/models", client=REMOTE).status_code == 200


def test_without_a_token_admin_routes_answer_loopback_only() -> None:
    app = _app(None)
    assert _call(app, "POST", "/sessions", json={"session_id": "a"}).status_code == 200
    r = _call(app, "POST", "/sessions", json={"session_id": "b"}, client=REMOTE)
    assert r.status_code == 403 and "10.1.2.3" in r.json()["error"]["message"]


def test_an_app_without_a_token_is_not_bound_off_loopback() -> None:
    with pytest.raises(ValueError, match="admin routes have no token"):
        start_server_in_thread(_app(None), "0.0.0.0")
