"""An open streamed answer of one server, as the `RolloutPool` hands it to the gateway (`forward_stream`).

Its events come over HTTP (server-sent events, parsed), or, from an embedded server of this process, as the
server's own event dicts (`app.DirectCalls.stream`: no HTTP, no JSON).

The pool routes and fails over until a server's first event; from then on the answer is this stream's, and
a failure can no longer move to another server: it is reported in the stream instead, and the server is
taken out of routing as a failed `forward` would take it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx

from agentrl.rollout._openai_protocol import build_error
from agentrl.rollout._sse import read_sse


class PoolStream:
    """A server's streamed answer, open: its events as parsed JSON, in order, as they arrive (`events`).

    After the first event there is no failover: an in-band error event (generation failed) or a broken
    connection takes the server out of routing, as a 5xx or a transport error does in `forward`, and ends
    `events` with an error body (`{"error": ...}`). Close it (`aclose`): it holds a slot of the server's
    `in_flight` until then.
    """

    def __init__(
        self, pool: Any, state: Any, events: AsyncIterator[Any], close: Callable[[], Awaitable[Any]]
    ) -> None:
        """`pool`: the `RolloutPool` that marks `state` (its `ServerState`) when the stream fails. `events`: the
        server's events (dicts, then `"[DONE]"`); `close` stops them (closes the connection or the generator)."""
        self.server, self.policy_version = state.url, state.policy_version
        self._pool, self._state = pool, state
        self._payloads, self._close = events, close
        self._first: Any = None
        self._closed = False

    @classmethod
    def over_http(cls, pool: Any, state: Any, response: httpx.Response) -> PoolStream:
        """The stream of an HTTP response of server-sent events."""
        return cls(pool, state, _parsed_events(response), response.aclose)

    async def peek(self) -> None:
        """Wait for the first event (a ValueError when the stream ends before one)."""
        self._first = await anext(self._payloads, None)
        if self._first is None:
            raise ValueError("the stream ended before its first event")

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Each event up to `[DONE]`; an error body last when the server or the connection failed."""
        try:
            event = self._first
            while event is not None and event != "[DONE]":
                if isinstance(event, dict) and isinstance(event.get("error"), dict):
                    self._pool.mark_server_error(self._state, 500, event)
                    yield event
                    return
                yield event
                event = await anext(self._payloads, None)
            if event is None:
                raise ValueError("the stream ended without [DONE]")
        except (httpx.HTTPError, ValueError, RuntimeError) as e:
            reason = (
                f"stream broke: {type(e).__name__}: {e}" if str(e) else f"stream broke: {type(e).__name__}"
            )
            self._pool.mark_unhealthy(self._state, reason)
            yield build_error(f"{self.server}: {reason}", None, 502)

    async def aclose(self) -> None:
        """Give the server's slot back and close the connection (also while being cancelled)."""
        if self._closed:
            return
        self._closed = True
        self._state.in_flight -= 1
        with anyio.CancelScope(shield=True):
            await self._close()


async def _parsed_events(response: httpx.Response) -> AsyncIterator[Any]:
    """Each server-sent event's data: parsed JSON, or the closing `"[DONE]"` as it is."""
    async for data in read_sse(response.aiter_lines()):
        yield data if data == "[DONE]" else json.loads(data)
