"""Rollouts collected ahead of training, on the run's event loop in a background thread: the asynchronous
loop's producer.

With `async_training.enable` and `staleness_threshold` N > 0, the batch of step k+N may be asked for as soon as
step k starts (the weights of step k-1 are then served), so its tokens were sampled by weights at most N versions
older than those it trains (the bound every token's `policy_version` is checked against). With
`partial_rollout=true` the batches asked for are collected at once, as tasks of one event loop: the slowest
episodes of one batch (an agent waiting on a slow tool) overlap the first episodes of the next, and new weights
go to the engines at once after an update (an episode in flight goes on with them, between two decode steps).
With `partial_rollout=false` batches are collected one after another and a weight push waits for the batch in
collection to end, so no batch mixes two versions.

A collection may hand over parts of its batch as they are ready (`collect(on_part)`: a task's group of episodes
once all of them finished); `parts()` yields those of the oldest batch as they come, so a streamed update
(`async_training.streaming_update`) trains on them while the batch's slowest episodes still run.

Nothing is asked for past the next checkpoint or validation step, so the pipeline is empty there: a checkpoint
holds exactly the batches trained, and the dataloader and collector state it saves are those of the last step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


_BATCH_END = object()
"""What `parts()` finds in a batch's queue once its collection ended (done, failed or cancelled)."""


class RolloutPipeline(Generic[T]):
    """Runs `collect(on_part)` once per `request()` on `loop`, which a background thread drives while the pipeline
    is open; `take()` returns the results in request order, `parts()` what the oldest batch handed over so far.
    Collections start in request order (so each batch's first tasks are drawn in order); `run` is how other
    coroutines reach the loop meanwhile."""

    def __init__(
        self,
        collect: Callable[[Callable[[Any], None]], Awaitable[T]],
        loop: asyncio.AbstractEventLoop,
        *,
        partial_rollout: bool,
    ) -> None:
        self._collect = collect
        self._loop = loop
        self.partial_rollout = partial_rollout
        self._pending: deque[tuple[concurrent.futures.Future[T], list[float], queue.SimpleQueue]] = deque()
        """Each batch asked for, with the clock at its collection's start and end (filled as it runs) and the
        parts it handed over."""
        self.last_batch_timing: dict[str, float] = {}
        """The batch `take` returned last: `async/batch_collect_s`, its collection's start to end (the wait on its
        slowest episode included), and `async/batch_head_start_s`, how long it had been collected when `take` was
        called (the overlap with the steps before)."""
        self._batch_lock = threading.Lock()  # held while a batch is collected (without partial rollouts)
        self._one_at_a_time: asyncio.Lock | None = None  # made on the loop
        self._closed = False
        self._thread = threading.Thread(target=loop.run_forever, name="rollout-pipeline", daemon=True)
        self._thread.start()

    @property
    def scheduled(self) -> int:
        """Batches asked for and not taken yet (collected, being collected or waiting)."""
        return len(self._pending)

    def request(self) -> None:
        """Ask for one more batch: it starts now (partial rollouts) or after those asked for before."""
        if self._closed:
            raise RuntimeError("the rollout pipeline is closed")
        times: list[float] = []
        parts: queue.SimpleQueue = queue.SimpleQueue()

        def on_part(part: Any) -> None:
            parts.put((time.perf_counter(), part))

        future = asyncio.run_coroutine_threadsafe(self._collect_one(times, on_part), self._loop)
        future.add_done_callback(lambda _: parts.put(_BATCH_END))
        self._pending.append((future, times, parts))

    def parts(self) -> Iterator[tuple[float, Any]]:
        """The parts the oldest batch asked for hands over, each with the clock when it was handed over, as they
        come, until its collection ends (`take` then returns it, or raises its error)."""
        if not self._pending:
            raise RuntimeError("parts() with no batch asked for")
        parts = self._pending[0][2]
        while (part := parts.get()) is not _BATCH_END:
            yield part
        parts.put(_BATCH_END)  # a second call ends at once

    def take(self) -> T:
        """The oldest batch asked for, waiting until it is collected; its collection error is raised here."""
        if not self._pending:
            raise RuntimeError("take() with no batch asked for")
        future, times, _ = self._pending.popleft()
        asked = time.perf_counter()
        result = future.result()
        self.last_batch_timing = {
            "async/batch_collect_s": times[1] - times[0],
            "async/batch_head_start_s": max(0.0, asked - times[0]),
        }
        return result

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the pipeline's loop (beside any batch in collection) and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def push_weights(self, push: Callable[[], T]) -> T:
        """Run `push` (the weight sync): at once with partial rollouts, else once the batch in collection ends."""
        if self.partial_rollout:
            return push()
        with self._batch_lock:
            return push()

    def close(self, wait_s: float = 30.0) -> None:
        """Cancel the batches not taken, wait up to `wait_s` for them to stop, and hand the loop back (the
        thread stops driving it)."""
        self._closed = True
        futures = [future for future, _, _ in self._pending]
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures, timeout=wait_s)
        self._pending.clear()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=wait_s)

    async def _collect_one(self, times: list[float], on_part: Callable[[Any], None]) -> T:
        if self.partial_rollout:
            return await self._timed_collect(times, on_part)
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Lock()
        async with self._one_at_a_time:  # FIFO: batches in request order
            with self._batch_lock:  # blocks the loop only while a push runs: no other batch is collected then
                return await self._timed_collect(times, on_part)

    async def _timed_collect(self, times: list[float], on_part: Callable[[Any], None]) -> T:
        times.append(time.perf_counter())
        try:
            return await self._collect(on_part)
        finally:
            times.append(time.perf_counter())


def steps_to_request(
    step: int, total_steps: int, staleness: int, boundaries: Callable[[int], bool]
) -> list[int]:
    """The steps whose batches may be asked for once step `step` starts: up to `staleness` ahead, never past the
    first boundary step (a checkpoint or validation) at or after `step`."""
    last = min(total_steps, step + staleness)
    for candidate in range(step, last):
        if boundaries(candidate):
            return list(range(step + 1, candidate + 1)) if candidate > step else []
    return list(range(step + 1, last + 1))
