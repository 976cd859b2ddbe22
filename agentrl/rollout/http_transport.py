"""An HTTP transport that keeps httpx's per-request bookkeeping short at high concurrency.

httpcore's connection pool re-examines every connection it holds and every request waiting in it each time a
request arrives or a response closes (`AsyncConnectionPool._assign_requests_to_connections`: `is_idle`,
`has_expired`, a `getpeername` per connection), so one pool's cost per request grows with the number of calls in
flight. With 128 episodes calling servers in other processes (the Ray backend, vLLM servers), 64% of the
gateway's event loop went there on an H100 and the engine, starved of requests, decoded ~10 rows a step
instead of ~90 (docs/benchmarks.md). Spreading the calls over several small pools keeps each scan short;
`benchmarks/http_pool.py` measures the client's CPU time per request both ways.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator

import httpx

DEFAULT_SHARDS = 16


class ShardedHTTPTransport(httpx.AsyncBaseTransport):
    """`shards` independent `httpx.AsyncHTTPTransport` pools; each request goes to the one with the fewest
    requests in flight (a response counts until its body is closed), so every pool holds about 1/`shards` of
    the connections. `max_connections` and `max_keepalive_connections` are totals over the pools (no more
    pools than `max_connections`)."""

    def __init__(
        self, max_connections: int, max_keepalive_connections: int, shards: int = DEFAULT_SHARDS
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        shards = min(shards, max_connections)  # every pool may open a connection
        context = _ssl_context()  # one for all pools: each built its own in ~35 ms (0.57 s for 16, 2 cores)
        self.pools = [
            httpx.AsyncHTTPTransport(
                verify=context,
                limits=httpx.Limits(
                    max_connections=_share(max_connections, shards, i),
                    max_keepalive_connections=_share(max_keepalive_connections, shards, i),
                ),
            )
            for i in range(shards)
        ]
        self.in_flight = [0] * shards

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = min(range(len(self.pools)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        try:
            response = await self.pools[index].handle_async_request(request)
        except BaseException:
            self.in_flight[index] -= 1
            raise
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_ReleasingStream(response.stream, self, index),
            extensions=response.extensions,
        )

    def _release(self, index: int) -> None:
        self.in_flight[index] -= 1

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


def _share(total: int, parts: int, index: int) -> int:
    """Pool `index`'s part of `total`: the parts differ by at most one and add up to `total`."""
    return total // parts + (1 if index < total % parts else 0)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi's roots), built once per process: the pool makes a client per
    training step's event loop."""
    return httpx.create_ssl_context()


class _ReleasingStream(httpx.AsyncByteStream):
    """A response body that gives its pool's in-flight slot back once, when it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, owner: ShardedHTTPTransport, index: int) -> None:
        self._stream, self._owner, self._index = stream, owner, index
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if not self._released:
                self._released = True
                self._owner._release(self._index)
