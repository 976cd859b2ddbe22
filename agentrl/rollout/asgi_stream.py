"""Calls to an ASGI app of this process whose responses stream: the body reaches the caller as the app sends it.

httpx's `ASGITransport` runs the app to its end and then hands over the body it collected. Through it, a flow of
the trainer that streams (`stream=True` to the gateway in this process, `InProcessFirstTransport`) got its first
chunk only once the last was generated, all of them in one burst, where a client over TCP gets each as the
engine makes it; and a client that stopped reading could not stop the generation. Here the app runs as a task
of the caller's event loop: the response returns at the app's `http.response.start`, its body is read part by
part as the app sends them, and closing the response is the client going away (the app's `receive` answers
`http.disconnect`, its `send` raises `OSError`), as a closed connection is to a server. A caller cancelled
before the response starts cancels the app, as when it ran inside the caller's task.

A failure keeps the TCP path's meaning: an app that raises before its response starts answers 500 (what
uvicorn sends); one that raises, or returns, in the middle of its body ends the body with
`httpx.RemoteProtocolError` (a connection closed before the whole message), never a shorter body read as whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

logger = logging.getLogger(__name__)

CLIENT = ("127.0.0.1", 123)
"""The peer an app sees (`request.client`): httpx's `ASGITransport` reports the same."""

_END = object()
"""The body's last part was sent."""

_RUNNING: set[asyncio.Task] = set()
"""Apps still running after their caller stopped reading (held so the loop does not drop them)."""


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """An httpx transport that calls `app` in the caller's event loop (asyncio) and streams its responses."""

    def __init__(self, app: Any, client: tuple[str, int] = CLIENT) -> None:
        self.app, self.client = app, client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not isinstance(request.stream, httpx.AsyncByteStream):
            raise TypeError("StreamingASGITransport needs an async request body (httpx.AsyncClient)")
        exchange = _Exchange(self.app, _scope(request, self.client), request.stream, request.method == "HEAD")
        return await exchange.start()


def _scope(request: httpx.Request, client: tuple[str, int]) -> dict[str, Any]:
    """The ASGI HTTP scope of `request` (ASGI 3.0)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "scheme": request.url.scheme,
        "path": request.url.path,
        "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query,
        "server": (request.url.host, request.url.port),
        "client": client,
        "root_path": "",
    }


class _Exchange:
    """One request: the app's task, its response head once sent, its body parts queued for the reader."""

    def __init__(self, app: Any, scope: dict[str, Any], body: httpx.AsyncByteStream, head_only: bool) -> None:
        self.app, self.scope, self.head_only = app, scope, head_only
        self.request_parts: AsyncIterator[bytes] = body.__aiter__()
        self.request_done = False
        self.head: asyncio.Future[tuple[int, list]] = asyncio.get_running_loop().create_future()
        self.parts: asyncio.Queue[Any] = asyncio.Queue()
        self.body_done = False
        self.gone = asyncio.Event()
        """Set when the reader closed the response (or stopped waiting for it): the client went away."""

    async def start(self) -> httpx.Response:
        task = asyncio.get_running_loop().create_task(self._run())
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)
        try:
            status, headers = await asyncio.shield(self.head)
        except BaseException:  # the caller gave up (cancelled, timed out) before the answer began
            self.gone.set()
            # Stop the app with it, as when the app ran inside the caller's task (httpx's ASGITransport): a
            # rollout past `agent.timeout` aborts its gateway call and the engine's request, recording nothing.
            task.cancel()
            raise
        return httpx.Response(status, headers=headers, stream=_Body(self))

    async def receive(self) -> dict[str, Any]:
        if not self.request_done:
            try:
                part = await self.request_parts.__anext__()
            except StopAsyncIteration:
                self.request_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": part, "more_body": True}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone.is_set():  # uvicorn too raises an OSError to an app that sends after a disconnect
            raise OSError("the client closed the response")
        if message["type"] == "http.response.start":
            self.head.set_result((message["status"], message.get("headers", [])))
        elif message["type"] == "http.response.body" and not self.body_done:
            if message.get("body") and not self.head_only:
                self.parts.put_nowait(message["body"])
            if not message.get("more_body", False):
                self.body_done = True
                self.parts.put_nowait(_END)

    async def _run(self) -> None:
        failure: BaseException | None = None
        try:
            await self.app(self.scope, self.receive, self.send)
        except Exception as exc:  # noqa: BLE001 - becomes the response's failure, as over TCP
            failure = exc
            if not self.gone.is_set():  # uvicorn logs an app that raised, unless its client had left
                logger.error("in-process app failed on %s", self.scope["path"], exc_info=True)
        except asyncio.CancelledError as exc:
            failure = exc
            raise
        finally:
            if not self.head.done():
                self.head.set_result((500, [(b"content-type", b"text/plain; charset=utf-8")]))
                self.body_done = True
                self.parts.put_nowait(b"Internal Server Error")
                self.parts.put_nowait(_END)
            elif not self.body_done:
                self.body_done = True
                self.parts.put_nowait(failure or RuntimeError("the app returned before the end of its body"))


class _Body(httpx.AsyncByteStream):
    """The response body: the app's parts as they are sent; closing it tells the app the client left."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (part := await self.exchange.parts.get()) is not _END:
            if isinstance(part, BaseException):
                raise httpx.RemoteProtocolError(
                    f"in-process app ended {self.exchange.scope['path']}'s body early: {part!r}"
                ) from part
            yield part

    async def aclose(self) -> None:
        self.exchange.gone.set()
