"""`StreamingASGITransport`: an app of this process answers part by part, hears a reader that leaves, and a body
it breaks off reads as broken, as over TCP."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from agentrl.rollout.asgi_stream import StreamingASGITransport


def _app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/parts")
    async def parts() -> StreamingResponse:
        async def body():
            yield b"first;"
            await state["go_on"].wait()  # the second part only once the caller has read the first
            yield b"second"

        return StreamingResponse(body())

    @app.get("/endless")
    async def endless() -> StreamingResponse:
        async def body():
            try:
                while True:
                    yield b"tick;"
                    await asyncio.sleep(0.01)
            finally:
                state["stopped"].set()

        return StreamingResponse(body())

    @app.get("/breaks")
    async def breaks() -> StreamingResponse:
        async def body():
            yield b"half;"
            raise RuntimeError("generation failed")

        return StreamingResponse(body())

    @app.get("/slow")
    async def slow() -> dict:
        try:
            await asyncio.sleep(60)
        finally:
            state["stopped"].set()
        return {}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"got": (await request.json())["x"], "client": list(request.client)}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("handler failed")

    return app


async def _client(state: dict) -> httpx.AsyncClient:
    state.update(go_on=asyncio.Event(), stopped=asyncio.Event())
    return httpx.AsyncClient(transport=StreamingASGITransport(_app(state)), base_url="http://app")


def test_a_streamed_body_reaches_the_caller_part_by_part() -> None:
    """The first part is read while the app still waits to send the second: httpx's ASGITransport would wait
    for the app's end first, and the app would wait forever."""

    async def go() -> list[bytes]:
        state: dict = {}
        async with await _client(state) as client, client.stream("GET", "/parts") as response:
            parts = response.aiter_raw()
            first = await asyncio.wait_for(anext(parts), 5)
            state["go_on"].set()
            return [first] + [part async for part in parts]

    assert asyncio.run(asyncio.wait_for(go(), 10)) == [b"first;", b"second"]


def test_closing_the_response_tells_the_app_the_client_left() -> None:
    async def go() -> bytes:
        state: dict = {}
        async with await _client(state) as client:
            async with client.stream("GET", "/endless") as response:
                first = await anext(response.aiter_raw())
            await asyncio.wait_for(state["stopped"].wait(), 5)  # the endless body was stopped
            return first

    assert asyncio.run(asyncio.wait_for(go(), 10)) == b"tick;"


def test_a_reader_cancelled_mid_body_stops_the_app() -> None:
    """A rollout that runs past `agent.timeout` is cancelled while it reads: the app is told its client left."""

    async def go() -> None:
        state: dict = {}
        async with await _client(state) as client:

            async def read_forever() -> None:
                async with client.stream("GET", "/endless") as response:
                    async for _ in response.aiter_raw():
                        pass

            with pytest.raises(TimeoutError):
                await asyncio.wait_for(read_forever(), 0.2)
            await asyncio.wait_for(state["stopped"].wait(), 5)

    asyncio.run(go())


def test_a_caller_that_gives_up_before_the_answer_stops_the_app() -> None:
    """A rollout cancelled while its (unstreamed) call waits: the handler stops with it, as when the app ran
    inside the caller's task, rather than generating on for nobody."""

    async def go() -> None:
        state: dict = {}
        async with await _client(state) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.get("/slow"), 0.2)
            await asyncio.wait_for(state["stopped"].wait(), 5)

    asyncio.run(go())


def test_a_body_the_app_breaks_off_is_an_error_not_a_short_answer() -> None:
    async def go() -> list[bytes]:
        got: list[bytes] = []
        async with await _client({}) as client, client.stream("GET", "/breaks") as response:
            assert response.status_code == 200
            async for part in response.aiter_raw():
                got.append(part)
        return got

    with pytest.raises(httpx.RemoteProtocolError, match="generation failed"):
        asyncio.run(go())


def test_request_bodies_arrive_and_a_failing_handler_answers_500() -> None:
    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with await _client({}) as client:
            return await client.post("/echo", json={"x": 7}), await client.get("/boom")

    echo, boom = asyncio.run(go())
    assert echo.json() == {"got": 7, "client": ["127.0.0.1", 123]}
    assert boom.status_code == 500
