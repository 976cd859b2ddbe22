"""`InProcessFirstTransport`: an app this process serves is called through ASGI in the caller's thread (no TCP
hop); once it stops serving, or for any other origin, requests go to the network."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI

from agentrl.rollout.http_server import InProcessFirstTransport, start_server_in_thread


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
