"""`ShardedHTTPTransport` against a real server on loopback: concurrent calls spread over its small pools (so
httpcore's per-request scan stays short), answers are the server's, and every request, streamed, failed or
not, gives its slot back."""

from __future__ import annotations

import asyncio
import socket
import ssl

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from agentrl.rollout.http_transport import ShardedHTTPTransport
from agentrl.rollout.uvicorn_thread import start_server_in_thread

CONCURRENT = 64


def _app() -> FastAPI:
    app = FastAPI()
    arrived = {"count": 0}
    state: dict[str, asyncio.Event] = {}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/together/{i}")
    async def together(i: int) -> dict:
        """Answers once CONCURRENT calls are open at once, so the client must hold them all in flight."""
        everyone = state.setdefault("everyone", asyncio.Event())
        arrived["count"] += 1
        if arrived["count"] >= CONCURRENT:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), timeout=20)
        return {"i": i}

    @app.get("/echo/{i}")
    async def echo(i: int) -> dict:
        return {"i": i}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            for part in (b"a", b"b", b"c"):
                yield part
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks(), media_type="text/plain")

    return app


@pytest.fixture(scope="module")
def server():
    handle = start_server_in_thread(_app())
    yield handle
    handle.stop()


def _connections(transport: ShardedHTTPTransport) -> list[int]:
    return [len(pool._pool.connections) for pool in transport.pools]


def test_concurrent_calls_spread_over_the_pools_and_answer_right(server):
    transport = ShardedHTTPTransport(max_connections=256, max_keepalive_connections=256, shards=16)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            answers = await asyncio.gather(
                *(client.get(f"{server.url}/together/{i}") for i in range(CONCURRENT))
            )
            connections = _connections(transport)
            assert sum(connections) == CONCURRENT  # all open at once, one connection each
            assert max(connections) == CONCURRENT // 16  # no pool holds more than its share
            assert transport.in_flight == [0] * 16
            return [a.json() for a in answers]

    assert asyncio.run(run()) == [{"i": i} for i in range(CONCURRENT)]


def test_one_call_at_a_time_reuses_one_kept_alive_connection(server):
    transport = ShardedHTTPTransport(max_connections=64, max_keepalive_connections=16, shards=8)

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            for i in range(10):
                assert (await client.get(f"{server.url}/echo/{i}")).json() == {"i": i}
            assert sum(_connections(transport)) == 1

    asyncio.run(run())


def test_a_stream_holds_its_slot_until_closed(server):
    transport = ShardedHTTPTransport(max_connections=8, max_keepalive_connections=8, shards=4)

    async def run() -> bytes:
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            async with client.stream("GET", f"{server.url}/stream") as response:
                assert transport.in_flight == [1, 0, 0, 0]
                # the next call goes to a pool with nothing in flight
                assert (await client.get(f"{server.url}/echo/1")).json() == {"i": 1}
                assert transport.in_flight == [1, 0, 0, 0]
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            assert transport.in_flight == [0, 0, 0, 0]
            assert _connections(transport)[:2] == [1, 1]
            return body

    assert asyncio.run(run()) == b"abc"


def test_a_failed_call_gives_its_slot_back():
    transport = ShardedHTTPTransport(max_connections=8, max_keepalive_connections=8, shards=2)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{port}/")

    asyncio.run(run())
    assert transport.in_flight == [0, 0]


def test_limits_are_totals_over_the_pools():
    transport = ShardedHTTPTransport(max_connections=10, max_keepalive_connections=3, shards=4)
    limits = [(p._pool._max_connections, p._pool._max_keepalive_connections) for p in transport.pools]
    assert limits == [(3, 1), (3, 1), (2, 1), (2, 0)]
    few = ShardedHTTPTransport(max_connections=3, max_keepalive_connections=3, shards=16)
    assert [p._pool._max_connections for p in few.pools] == [1, 1, 1]  # no pool without a connection
    with pytest.raises(ValueError, match="shards"):
        ShardedHTTPTransport(max_connections=4, max_keepalive_connections=4, shards=0)
    with pytest.raises(ValueError, match="max_connections"):
        ShardedHTTPTransport(max_connections=0, max_keepalive_connections=0)


def test_pools_share_one_tls_context():
    """Building a context takes ~35 ms on 2 cores, and the pool builds a transport per training step."""
    first = ShardedHTTPTransport(max_connections=16, max_keepalive_connections=16, shards=16)
    second = ShardedHTTPTransport(max_connections=16, max_keepalive_connections=16, shards=4)
    contexts = {id(p._pool._ssl_context) for p in first.pools + second.pools}
    assert len(contexts) == 1
    assert first.pools[0]._pool._ssl_context.verify_mode == ssl.CERT_REQUIRED
