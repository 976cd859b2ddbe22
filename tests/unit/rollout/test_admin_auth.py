"""Admin routes need the bearer token on every bind, loopback included: 401 without one, 403 with a wrong one."""

from __future__ import annotations

import asyncio
import os
import stat

import httpx
import pytest
from fastapi import FastAPI

from agentrl.rollout.admin_auth import (
    ADMIN_TOKEN_ENV,
    admin_headers,
    process_admin_token,
    resolve_admin_token,
    write_token_file,
)
from agentrl.rollout.gateway import build_gateway_app
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.traces import TraceStore
from agentrl.types import SamplingParams

TRAIN = SamplingParams(max_tokens=8)
LOOPBACK = ("127.0.0.1", 1234)


def test_one_random_token_per_process_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    made = process_admin_token()
    assert len(made) >= 32 and process_admin_token() == made == resolve_admin_token()
    assert resolve_admin_token("mine") == "mine"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    assert resolve_admin_token() == "from-env" and resolve_admin_token("arg") == "arg"


def test_the_token_file_is_readable_by_its_owner_only(tmp_path) -> None:
    loose = tmp_path / "t"
    loose.write_text("old")
    os.chmod(loose, 0o644)  # an existing file is narrowed too
    path = write_token_file(loose, "s3cret")
    assert path.read_text() == "s3cret" and stat.S_IMODE(path.stat().st_mode) == 0o600
    nested = write_token_file(tmp_path / "a" / "b", "x")
    assert stat.S_IMODE(nested.stat().st_mode) == 0o600


def _app(token: str | None) -> FastAPI:
    pool = RolloutPool(["http://srv"], model_name="m")
    return build_gateway_app(pool, TraceStore(), sampling_train=TRAIN, admin_token=token)


def _call(app: FastAPI, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app, client=LOOPBACK)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.request(method, url, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/sessions", {"session_id": "a"}), ("GET", "/sessions/a/traces", None),
     ("DELETE", "/sessions/a", None)],
)  # fmt: skip
def test_gateway_admin_routes_refuse_loopback_calls_without_the_token(method, path, body) -> None:
    app = _app("s3cret")
    for headers in ({}, {"Authorization": "s3cret"}, {"Authorization": "Bearer "}):
        r = _call(app, method, path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert (
            r.json()["error"]["type"] == "AuthenticationError"
            and "bearer token" in r.json()["error"]["message"]
        )
    r = _call(app, method, path, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"


def test_the_right_token_opens_them_and_model_routes_need_none() -> None:
    app = _app("s3cret")
    ok = {"Authorization": "Bearer s3cret"}
    assert _call(app, "POST", "/sessions", json={"session_id": "a"}, headers=ok).status_code == 200
    assert _call(app, "GET", "/sessions/a/traces", headers=ok).json() == []
    assert _call(app, "GET", "/sessions/a/v1/models").status_code == 200
    assert _call(app, "GET", "/health").status_code in (200, 503)  # no server behind it: unhealthy, not 401
    assert _call(app, "DELETE", "/sessions/a", headers=ok).status_code == 200


def test_without_a_token_an_app_takes_the_process_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    app = _app(None)
    assert app.state.admin_token == process_admin_token()
    assert _call(app, "POST", "/sessions", json={"session_id": "a"}).status_code == 401
    headers = admin_headers(process_admin_token())
    assert _call(app, "POST", "/sessions", json={"session_id": "a"}, headers=headers).status_code == 200


def test_unknown_routes_answer_in_the_same_error_shape() -> None:
    r = _call(_app("s3cret"), "GET", "/nowhere")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and "/nowhere" in r.json()["error"]["message"]
