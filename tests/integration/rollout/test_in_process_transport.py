"""`InProcessFirstTransport`: an app this process serves is called through ASGI in the caller's thread (no TCP
hop); once it stops serving, or for any other origin, requests go to the network."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI

from agentrl.rollout.uvicorn_thread import InProcessFirstTransport, start_server_in_thread


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/thread")
    async def thread() -> dict:
        return {"thread": threading.get_ident()}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("handler failed")

    return app


def test_local_app_answers_in_the_callers_thread_and_network_after_stop():
    handle = start_server_in_thread(_app())

    async def fetch(path: str, in_process: bool) -> httpx.Response:
        network = httpx.AsyncHTTPTransport()
        transport = InProcessFirstTransport(network) if in_process else network
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            return await client.get(f"{handle.url}{path}")

    caller = threading.get_ident()
    assert asyncio.run(fetch("/thread", in_process=True)).json()["thread"] == caller
    assert asyncio.run(fetch("/thread", in_process=False)).json()["thread"] != caller  # uvicorn's thread
    assert asyncio.run(fetch("/boom", in_process=True)).status_code == 500  # as over TCP, not a raise
    handle.stop()
    with pytest.raises(httpx.ConnectError):  # no longer served here: the network path, and nobody listens
        asyncio.run(fetch("/thread", in_process=True))


def test_network_transport_is_built_only_when_a_request_leaves_the_process():
    """A factory is called at the first request to an origin this process does not serve, not before:
    a collector reaching only its own gateway never builds an SSL context."""
    handle = start_server_in_thread(_app())
    built: list[httpx.AsyncHTTPTransport] = []

    def network() -> httpx.AsyncHTTPTransport:
        built.append(httpx.AsyncHTTPTransport())
        return built[-1]

    async def fetch_local_then_remote() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=InProcessFirstTransport(network), timeout=5) as client:
            assert (await client.get(f"{handle.url}/health")).json() == {"ok": True}
            before = len(built)
            handle.stop()  # the same origin is now off-process: the network path, nobody listens
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{handle.url}/health")
            return before, len(built)

    assert asyncio.run(fetch_local_then_remote()) == (0, 1)
