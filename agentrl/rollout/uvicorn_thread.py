"""Run an ASGI app (server, gateway) with uvicorn in a daemon thread on a free loopback port.

Used by the gateway, the tests and the trainer: the caller keeps its own event loop and threads,
the server gets its own loop in its own thread. The socket is bound before uvicorn starts
(port 0 = the OS picks a free port), so the port is known at once and cannot be taken by a
concurrent test between choosing and binding.

Apps served this way are also listed by URL (`find_local_app`), so clients in the same process (the
`RolloutPool` calling its servers, the collector calling the gateway) reach them through
`InProcessFirstTransport`: in-process ASGI instead of a TCP hop, streamed responses streamed (`asgi_stream.py`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from agentrl.rollout.asgi_stream import StreamingASGITransport

__all__ = ["InProcessFirstTransport", "ServerHandle", "find_local_app", "start_server_in_thread"]

_LOCAL_APPS: dict[str, Any] = {}
"""`http://host:port` -> the ASGI app this process serves there (registered while it runs)."""


def find_local_app(origin: str) -> Any | None:
    """The app this process serves at `origin` (`http://host:port`), or None."""
    return _LOCAL_APPS.get(origin.rstrip("/"))


class InProcessFirstTransport(httpx.AsyncBaseTransport):
    """Requests to an app this process serves go to it through ASGI, in the caller's event loop (streamed
    responses part by part, `StreamingASGITransport`); the rest go to `network`. Measured on 128 concurrent
    calls, the TCP hop plus uvicorn's thread cost more than the model on CPU (docs/benchmarks.md,
    benchmarks/rollout_overhead.py).

    `network` may be a factory, called at the first request that leaves the process: an
    `httpx.AsyncHTTPTransport` builds an SSL context (~50 ms on 2 CPU cores), which a collector that
    only reaches its own gateway would pay at every rollout round for nothing."""

    def __init__(self, network: httpx.AsyncBaseTransport | Callable[[], httpx.AsyncBaseTransport]) -> None:
        self._network = network if isinstance(network, httpx.AsyncBaseTransport) else None
        self._make_network = None if self._network is not None else network
        self._local: dict[str, tuple[Any, StreamingASGITransport]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        app = find_local_app(origin)
        if app is None:
            if self._network is None:
                self._network = self._make_network()
            return await self._network.handle_async_request(request)
        cached = self._local.get(origin)
        if cached is None or cached[0] is not app:
            # Exceptions become 500s, as over TCP, so failover treats both paths alike.
            cached = (app, StreamingASGITransport(app))
            self._local[origin] = cached
        return await cached[1].handle_async_request(request)

    async def aclose(self) -> None:
        if self._network is not None:
            await self._network.aclose()


class ServerHandle:
    """A running server: `.url` (http://host:port), `.port`, `.stop()`; also a context manager."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int) -> None:
        self._server, self._thread = server, thread
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit (closing open connections) and wait for its thread."""
        _LOCAL_APPS.pop(self.url, None)
        self._server.should_exit = True
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout=timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, health_path: str = "/health", timeout: float = 30.0
) -> ServerHandle:
    """Serve `app` from a daemon thread; returns once `GET {health_path}` answers 200.

    Raises RuntimeError if the server thread dies or health does not answer within `timeout`, and OSError
    (errno EADDRINUSE) when `port` is taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"http-{bound_port}", daemon=True
    )
    thread.start()
    handle = ServerHandle(server, thread, host, bound_port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError(f"server thread on {handle.url} exited during start-up")
        try:
            if httpx.get(handle.url + health_path, timeout=2.0).status_code == 200:
                _LOCAL_APPS[handle.url] = app
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    handle.stop()
    raise RuntimeError(f"server on {handle.url} did not answer {health_path} within {timeout:.0f}s")
