"""RolloutPool: sticky least-loaded routing, the health state machine, failover and admin broadcast.

The servers are small in-process FastAPI apps reached through httpx's ASGI transport (one app that
answers for several hosts), so every HTTP exchange is real but no port or thread is needed.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rollout.pool import NoHealthyServerError, RolloutPool

A, B, C = "http://a", "http://b", "http://c"


class Fleet:
    """Servers keyed by host: each answers, fails with 500, or is 'down' (health 503 too)."""

    def __init__(self, hosts: list[str]) -> None:
        self.status = {h: 200 for h in hosts}
        self.calls: list[tuple[str, str, dict]] = []
        self.app = FastAPI()

        @self.app.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_route(path: str, request: Request) -> JSONResponse:
            host = request.url.hostname
            body = await request.json() if request.method == "POST" else {}
            self.calls.append((host, "/" + path, body))
            status = self.status[host]
            return JSONResponse({"host": host, "path": "/" + path}, status_code=status)

    def pool(self, hosts: list[str], **kw) -> RolloutPool:
        kw.setdefault("probe_interval", 0.0)
        return RolloutPool(
            [f"http://{h}" for h in hosts], model_name="m", transport=httpx.ASGITransport(self.app), **kw
        )


@pytest.fixture
def fleet() -> Fleet:
    return Fleet(["a", "b", "c"])


def test_new_sessions_go_to_least_loaded_and_stay(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b", "c"])
    a, b, c = pool.servers
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick_server("s1") is b
    b.in_flight = 5  # s1 stays on b even though b is now the busiest (prefix cache)
    assert pool.pick_server("s1") is b
    assert pool.pick_server("s2") is c  # c: 2 in flight < a: 3 < b: 5
    assert (a.sessions, b.sessions, c.sessions) == (0, 1, 1)


def test_ties_break_by_session_count_then_order(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b", "c"])
    a, b, c = pool.servers
    assert [pool.pick_server(f"s{i}").url for i in range(4)] == [A, B, C, A]
    pool.forget_session("s1")  # b now holds no session
    assert pool.pick_server("s9") is b
    assert (a.sessions, b.sessions, c.sessions) == (2, 1, 1)


def test_unhealthy_server_is_skipped_and_session_moves(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b"], probe_interval=60)
    a, b = pool.servers
    assert pool.pick_server("s1") is a
    pool.mark_unhealthy(a, "boom")
    assert pool.pick_server("s1") is b
    assert pool.server_of("s1") == B and (a.sessions, b.sessions) == (0, 1)
    pool.mark_unhealthy(b, "boom too")
    with pytest.raises(NoHealthyServerError, match="http://a: boom; http://b: boom too"):
        pool.pick_server("s1")


def test_forward_fails_over_on_5xx_and_marks_server(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b"], probe_interval=60)
    fleet.status["a"] = 500

    resp = asyncio.run(pool.forward("s1", "/v1/completions", {"x": 1}))

    assert (resp.status, resp.server, resp.body["host"]) == (200, B, "b")
    assert [h for h, _, _ in fleet.calls] == ["a", "b"]
    a, b = pool.servers
    assert not a.healthy and "HTTP 500" in a.last_error and b.healthy
    assert pool.server_of("s1") == B and a.in_flight == 0 and b.in_flight == 0


def test_4xx_is_returned_not_retried(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b"])
    fleet.status["a"] = 400
    resp = asyncio.run(pool.forward("s1", "/v1/completions", {}))
    assert (resp.status, resp.server) == (400, A)
    assert len(fleet.calls) == 1 and pool.servers[0].healthy


def test_retries_are_bounded(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b", "c"], max_retries=1, probe_interval=60)
    fleet.status.update(a=500, b=500, c=500)
    resp = asyncio.run(pool.forward("s1", "/v1/completions", {}))
    assert resp.status == 503
    assert [h for h, _, _ in fleet.calls] == ["a", "b"]  # 1 try + 1 retry, c never asked
    assert "http://a: HTTP 500" in resp.body["error"]["message"]


def test_unhealthy_server_comes_back_after_probe(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b"], probe_interval=60)
    a, _ = pool.servers
    fleet.status["a"] = 500

    async def scenario() -> list[str]:
        await pool.forward("s1", "/v1/completions", {})
        assert not a.healthy
        assert await pool.probe_unhealthy() == []  # health answers 500 too: still down
        fleet.status["a"] = 200
        return await pool.probe_unhealthy()

    assert asyncio.run(scenario()) == [A]
    assert a.healthy and a.last_error == ""


def test_all_down_probes_inline_before_giving_up(fleet: Fleet) -> None:
    pool = fleet.pool(["a"], probe_interval=60)
    pool.mark_unhealthy(pool.servers[0], "was down")  # but it is up again
    resp = asyncio.run(pool.forward("s1", "/x", {}))
    assert resp.status == 200 and [p for _, p, _ in fleet.calls] == ["/health", "/x"]


def test_weight_update_broadcast_uses_each_engines_route(fleet: Fleet) -> None:
    pool = RolloutPool(
        [A, type("V", (), {"url": B, "engine": "vllm"})()],
        model_name="m",
        transport=httpx.ASGITransport(fleet.app),
    )
    version = asyncio.run(pool.update_weights("/w/step1"))
    assert version == 1 and [s.policy_version for s in pool.servers] == [1, 1]
    calls = sorted((h, p, b) for h, p, b in fleet.calls)
    assert calls == [
        ("a", "/update_weights", {"path": "/w/step1", "policy_version": 1}),
        ("b", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/step1"}}),
        ("b", "/reset_prefix_cache", {}),
    ]


def test_lora_broadcast_activates_adapter_and_reuses_name_inplace(fleet: Fleet) -> None:
    vllm_b = type("V", (), {"url": B, "engine": "vllm"})()
    pool = RolloutPool([vllm_b], model_name="m", transport=httpx.ASGITransport(fleet.app))
    asyncio.run(pool.load_lora_adapter("policy", "/ad/1"))
    asyncio.run(pool.load_lora_adapter("policy", "/ad/2"))
    assert pool.served_model == "policy" and pool.policy_version == 2
    assert [b for _, _, b in fleet.calls] == [
        {"lora_name": "policy", "lora_path": "/ad/1"},
        {"lora_name": "policy", "lora_path": "/ad/2", "load_inplace": True},
    ]


def test_server_that_missed_an_update_replays_it_before_serving(fleet: Fleet) -> None:
    pool = fleet.pool(["a", "b"], probe_interval=60)
    a, b = pool.servers
    fleet.status["a"] = 500

    async def scenario() -> None:
        await pool.update_weights("/w/1")  # a fails the update
        assert (a.policy_version, b.policy_version, a.healthy) == (0, 1, False)
        fleet.status["a"] = 200
        fleet.calls.clear()
        assert await pool.probe_unhealthy() == [A]

    asyncio.run(scenario())
    assert [p for _, p, _ in fleet.calls] == ["/health", "/update_weights"]
    assert a.policy_version == 1 and a.healthy


def test_sleep_and_wake_up_routes(fleet: Fleet) -> None:
    vllm_b = type("V", (), {"url": B, "engine": "vllm"})()
    pool = RolloutPool([A, vllm_b], model_name="m", transport=httpx.ASGITransport(fleet.app))
    asyncio.run(pool.sleep())
    asyncio.run(pool.wake_up())
    assert sorted((h, p) for h, p, _ in fleet.calls) == [
        ("a", "/sleep"), ("a", "/wake_up"), ("b", "/sleep"), ("b", "/wake_up"),
    ]  # fmt: skip


def test_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        RolloutPool([], model_name="m")
    with pytest.raises(ValueError, match="engine must be one of"):
        RolloutPool([A], model_name="m", engine="tgi")


def _echo_server():
    """A server of this process that reports which client port reached it (ASGI's is fixed at 123)."""
    from agentrl.rollout.uvicorn_thread import start_server_in_thread

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        await asyncio.sleep(body.get("sleep", 0))
        return {"port": request.client.port}

    return start_server_in_thread(app)


def test_servers_of_this_process_are_called_in_process() -> None:
    with _echo_server() as handle:
        inproc = RolloutPool([handle.url], model_name="m", request_timeout=0.5)
        tcp = RolloutPool([handle.url], model_name="m", in_process=False)

        async def go(pool: RolloutPool, body: dict):
            try:
                return await pool.forward("s", "/v1/completions", body)
            finally:
                await pool.aclose()

        assert asyncio.run(go(inproc, {})).body == {"port": 123}  # httpx.ASGITransport's client
        assert asyncio.run(go(tcp, {})).body["port"] != 123
        # httpx's timeout does not reach an ASGI app; the pool's own does, and fails the server over.
        slow = asyncio.run(go(inproc, {"sleep": 5}))
        assert slow.status == 503 and "TimeoutError" in slow.body["error"]["message"]
    # A stopped server is no longer in-process: the pool falls back to TCP and finds it gone.
    pool = RolloutPool([handle.url], model_name="m", max_retries=0, probe_interval=60)
    gone = asyncio.run(pool.forward("s", "/v1/completions", {}))
    assert gone.status == 503 and "ConnectError" in gone.body["error"]["message"]
