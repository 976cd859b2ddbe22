"""A server whose engine died is reported unhealthy at once, with the reason (issue 21).

vLLM answers a 5xx carrying `EngineDeadError`'s message once its engine core process died (e.g. SIGILL
in bfloat16 kernels on some x86 CPUs) and its `/health` turns 503; a server object with a process
(`VLLMServer`) whose process exited is seen without any request. The servers are in-process FastAPI apps
behind httpx's ASGI transport, as in test_pool.py; the exited process is a real one killed by SIGILL.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rollout.gateway import build_gateway_app
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.traces import TraceStore
from agentrl.types import SamplingParams

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class Servers:
    """Hosts answering a completion, or vLLM's engine-dead 500 (health 503) once `dead` holds them."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.app = FastAPI()

        @self.app.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_route(path: str, request: Request) -> JSONResponse:
            host = request.url.hostname
            self.calls.append((host, "/" + path))
            if host in self.dead:
                if path == "health":
                    return JSONResponse({}, status_code=503)
                error = {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}
                return JSONResponse({"error": error}, status_code=500)
            return JSONResponse({"host": host, "choices": [{"index": 0, "text": "x"}]})

    def pool(self, servers: list, **kw) -> RolloutPool:
        kw.setdefault("probe_interval", 60.0)
        return RolloutPool(servers, model_name="m", transport=httpx.ASGITransport(self.app), **kw)


def test_engine_dead_5xx_marks_the_server_with_the_reason_until_it_answers_health() -> None:
    servers = Servers()
    servers.dead.add("a")
    pool = servers.pool(["http://a", "http://b"])
    a, b = pool.servers

    async def scenario() -> None:
        resp = await pool.forward("s1", "/v1/completions", {})
        assert (resp.status, resp.server) == (200, "http://b")  # failed over
        assert not a.healthy and b.healthy
        assert a.last_error == f"engine died: HTTP 500: {ENGINE_DEAD}"
        health = {h["url"]: h for h in pool.server_health()}
        assert health["http://a"]["healthy"] is False
        assert health["http://a"]["error"].startswith(
            "engine died: HTTP 500: EngineCore encountered an issue"
        )
        assert health["http://b"] == {
            "url": "http://b", "healthy": True, "in_flight": 0, "policy_version": 0, "error": ""
        }  # fmt: skip
        assert await pool.probe_unhealthy() == []  # /health is 503: the reason stays, the check's follows
        assert a.last_error == f"engine died: HTTP 500: {ENGINE_DEAD}; health check answered HTTP 503"
        servers.dead.clear()  # a restarted server on the same address
        assert await pool.probe_unhealthy() == ["http://a"]
        assert a.healthy and a.last_error == "" and a.engine_dead == ""

    asyncio.run(scenario())


def test_gateway_answers_503_naming_the_dead_engine_and_health_turns_unhealthy() -> None:
    servers = Servers()
    servers.dead.add("a")
    pool = servers.pool(["http://a"])
    app = build_gateway_app(
        pool, TraceStore(), sampling_train=SamplingParams(max_tokens=4), allow_implicit_sessions=True
    )

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            call = await client.post("/sessions/s/v1/completions", json={"prompt": "hi"})
            return call, await client.get("/health")

    call, health = asyncio.run(go())
    assert call.status_code == 503
    assert "engine died: HTTP 500: EngineCore encountered an issue" in call.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["servers"][0]["healthy"] is False
    assert health.json()["servers"][0]["error"].startswith("engine died: HTTP 500: EngineCore")


def test_a_server_whose_process_exited_is_unhealthy_before_any_request() -> None:
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"],
        stderr=subprocess.DEVNULL,
    )
    killed.wait(timeout=30)
    servers = Servers()
    pool = servers.pool(
        [SimpleNamespace(url="http://a", engine="vllm", process=killed), "http://b"], engine="vllm"
    )

    (health_a, health_b) = pool.server_health()
    assert health_a["healthy"] is False and health_b["healthy"] is True
    assert health_a["error"] == "server process exited (exit code -4 (SIGILL))"
    resp = asyncio.run(pool.forward("s1", "/v1/completions", {}))
    assert resp.server == "http://b" and ("a", "/v1/completions") not in servers.calls
    assert asyncio.run(pool.probe_unhealthy()) == []  # no health call on a port nobody serves
    assert ("a", "/health") not in servers.calls
    assert pool.servers[0].last_error == "server process exited (exit code -4 (SIGILL))"
