"""The `openai.AsyncOpenAI` client a rollout's flow gets: the collector's shared HTTP client, the platform known.

A new AsyncOpenAI client asks for the platform it runs on (`get_platform`, for its `X-Stainless-OS` header) at
its first request, in a worker thread (`asyncify`), because the answer may need file reads. The collector builds
one client per rollout (the session is in its base URL), so every rollout paid a thread hop on the event loop
that also runs the gateway and the server: a fifth of the flow's time in `benchmarks/rollout_overhead.py`'s
collector row on 2 cores. The answer never changes within a process, so it is asked once, here, outside any
event loop, and given to every client.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx
import openai


@functools.cache
def _platform() -> Any:
    """openai's platform value for this process, or None where this openai has no `get_platform`."""
    try:
        from openai._base_client import get_platform
    except ImportError:
        return None
    return get_platform()


def flow_client(base_url: str, timeout: float, http_client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """An AsyncOpenAI client for one rollout's session: no retries (the collector retries whole rollouts), the
    shared HTTP client, and the platform set so its first request stays on the event loop."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="agentrl", max_retries=0, timeout=timeout, http_client=http_client
    )
    platform = _platform()
    if platform is not None and getattr(client, "_platform", False) is None:  # only where openai reads it
        client._platform = platform
    return client


def prime_platform() -> None:
    """Ask for the platform now (it may read files), so no event loop does it later."""
    _platform()
