"""The embedded server's admin routes and its sleep state, as seen by callers.

Admin routes (POST /update_weights, /v1/load_lora_adapter, /sleep, /wake_up) need the app's bearer token
(`admin_auth.py`): 401 without one, 403 with a wrong one. GET /is_sleeping is open. A weights or adapter path
the engine cannot read is a 400 naming the path, never a 500. While the engine sleeps, generation requests
wait for `/wake_up` at most `sleep_wait_s` seconds and then get a 503 that names the sleep (`wait_until_awake`):
a caller never hangs on a sleeping engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, FastAPI
from pydantic import BaseModel

from agentrl.rollout._openai_protocol import RequestError
from agentrl.rollout.admin_auth import build_admin_guard
from agentrl.rollout.engines._weights import read_state_dict

__all__ = ["SLEEP_WAIT_S", "SLEEPING_CODE", "add_admin_routes", "wait_until_awake"]

SLEEP_WAIT_S = 60.0
"""How long a generation request waits for a sleeping engine to wake up before it is answered 503."""
SLEEPING_CODE = "engine_sleeping"
"""`error.code` of the 503 a generation request gets when the engine stayed asleep past `sleep_wait_s`."""
_POLL_S = 0.02


class UpdateWeightsBody(BaseModel):
    path: str


class LoadLoraBody(BaseModel):
    lora_name: str
    lora_path: str


async def wait_until_awake(engine: Any, timeout: float) -> None:
    """Return once `engine` is awake; RequestError 503 (code `engine_sleeping`) if it sleeps past `timeout`."""
    if not getattr(engine, "is_sleeping", False):
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.is_sleeping:
        if asyncio.get_running_loop().time() >= deadline:
            raise RequestError(
                f"the engine is asleep (POST /sleep) and did not wake up within {timeout:g} s; "
                "retry after POST /wake_up (GET /health answers status 'sleeping' meanwhile)",
                None,
                503,
                code=SLEEPING_CODE,
            )
        await asyncio.sleep(_POLL_S)


def _read_weights(path: str) -> Any:
    try:
        return read_state_dict(path)
    except (ValueError, OSError) as error:
        message = str(error)
        raise RequestError(message if path in message else f"path {path!r}: {message}", "path") from error


def add_admin_routes(app: FastAPI, engine: Any, admin_token: str) -> None:
    """Add the weight, adapter and sleep routes over `engine` to `app`, guarded by `admin_token`."""
    admin = [Depends(build_admin_guard(admin_token))]

    @app.post("/update_weights", dependencies=admin)
    async def update_weights(body: UpdateWeightsBody) -> dict[str, Any]:
        state = await asyncio.to_thread(_read_weights, body.path)
        try:
            version = await asyncio.to_thread(engine.update_weights, state)
        except ValueError as error:
            raise RequestError(f"path {body.path!r}: {error}", "path") from error
        return {"policy_version": version, "weights_fingerprint": engine.weights_fingerprint()}

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(body: LoadLoraBody) -> dict[str, Any]:
        try:
            version = await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path)
        except (ValueError, OSError) as error:
            raise RequestError(f"lora_path: {error}", "lora_path") from error
        return {"status": "ok", "lora_name": body.lora_name, "policy_version": version}

    @app.post("/sleep", dependencies=admin)
    async def sleep() -> dict[str, bool]:
        try:
            await asyncio.to_thread(engine.sleep)
        except RuntimeError as error:
            raise RequestError(str(error), None, 409) from error
        return {"is_sleeping": True}

    @app.post("/wake_up", dependencies=admin)
    async def wake_up() -> dict[str, bool]:
        await asyncio.to_thread(engine.wake_up)
        return {"is_sleeping": False}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": engine.is_sleeping}
