"""A watchdog of the collection's event loop: a flow that blocks it (`time.sleep`, a sync HTTP client, heavy
CPU in `run`) stalls every rollout of the step, which then all time out with nothing saying why.

A heartbeat task stamps the time every `interval` seconds; a thread checks the stamp, so a stall is seen while
it lasts, not only after. The first stall past `threshold` seconds in a collection is logged once, naming the
flow class and the line the loop is stuck on, and saying to use async calls or `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import time
import traceback
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["LoopLagWatchdog"]


class LoopLagWatchdog:
    """`async with LoopLagWatchdog(flow, threshold=1.0):` around a collection; `.longest_stall` is the longest
    time (s) the loop went without running the heartbeat, `.warning` the message logged (None if none)."""

    def __init__(self, flow: Any, threshold: float, interval: float | None = None) -> None:
        code = getattr(flow, "_fn", None) or type(flow)  # an @agent_flow function, or the AgentFlow class
        self.flow_name = code.__qualname__
        self._flow_file = _source_file(code)
        self.threshold = threshold
        self.interval = interval if interval is not None else min(0.25, threshold / 4)
        self.longest_stall = 0.0
        self.warning: str | None = None
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = 0

    async def __aenter__(self) -> LoopLagWatchdog:
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    async def _heartbeat(self) -> None:
        while True:
            now = time.monotonic()
            self.longest_stall = max(self.longest_stall, now - self._beat - self.interval)
            self._beat = now
            await asyncio.sleep(self.interval)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            stalled = time.monotonic() - self._beat - self.interval
            if stalled >= self.threshold and self.warning is None:
                self.warning = self._describe(stalled)
                log.warning(self.warning)

    def _describe(self, stalled: float) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        where = _where(frame, self._flow_file) if frame is not None else "unknown"
        return (
            f"the event loop of rollout collection has been blocked for {stalled:.1f} s while running "
            f"{self.flow_name} (stuck at {where}): every rollout of the step waits meanwhile and may time out. "
            f"A flow's `run` must not block: use async calls (AsyncOpenAI, httpx.AsyncClient, asyncio.sleep) "
            f"or run blocking work with `await asyncio.to_thread(fn, ...)`, or run the flows in worker processes "
            f"(agent.num_workers=N), where a flow that blocks stalls only its own worker"
        )


def _source_file(code: Any) -> str | None:
    try:
        return inspect.getsourcefile(code)
    except (TypeError, OSError):
        return None


def _where(frame: Any, flow_file: str | None) -> str:
    """`file:line in function: code` of the innermost frame in the flow's own file, else the innermost one."""
    stack = traceback.extract_stack(frame)
    chosen = next((f for f in reversed(stack) if flow_file and f.filename == flow_file), stack[-1])
    code = f": {chosen.line.strip()}" if chosen.line else ""
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}{code}"
