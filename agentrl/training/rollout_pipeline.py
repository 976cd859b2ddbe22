"""Rollouts collected ahead of training, on an event loop in a background thread: the asynchronous loop's producer.

With `async_training.enable` and `staleness_threshold` N > 0, the batches of steps k+1..k+N are asked for when step
k begins (the weights of step k-1's update are then served), and the trainer takes them in order: a batch's tokens
were sampled by weights at most N versions older than those that train it (the bound every token's
`policy_version` is checked against).

Batches asked for are collected at the same time (`concurrent` > 1), each started in the order asked, on one event
loop: the episodes of the next batch start as soon as the collector's episode limit lets them, while the slowest
episodes of the batch before wait on their tools, instead of after all of them. A synchronous step, and a batch
collected alone, waits for its slowest episode. After an update the new weights go to the engines at once
(`partial_rollout=true`: an episode in flight goes on with them, between two decode steps) or when the batch being
collected ends (`partial_rollout=false`: no batch mixes two versions; the push waits for it, and batches are
collected one at a time).

Nothing is asked for past the next checkpoint or validation step, so the pipeline is empty there: a checkpoint
holds exactly the batches trained, and the dataloader and collector state it saves are those of the last step.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class RolloutPipeline(Generic[T]):
    """Runs `collect()` (a coroutine function) once per `request()` on its own event loop; `take()` returns the
    results in the order asked. Up to `concurrent` collections run at once, each started in the order asked (what
    runs before its first `await`, such as drawing its tasks, runs in that order too)."""

    def __init__(
        self, collect: Callable[[], Awaitable[T]], *, partial_rollout: bool, concurrent: int = 1
    ) -> None:
        if concurrent < 1:
            raise ValueError(f"concurrent must be at least 1, got {concurrent}")
        if concurrent > 1 and not partial_rollout:
            raise ValueError(
                "batches collected at the same time need partial rollouts (a push waits for none)"
            )
        self._collect = collect
        self.partial_rollout = partial_rollout
        self.concurrent = concurrent
        self._pending: deque[Future[T]] = deque()
        self._lock = threading.Lock()
        self._batch_lock = threading.Lock()  # held while a batch is collected (partial_rollout=false)
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(concurrent)  # bound to the loop on first use (Python >= 3.10)
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-pipeline", daemon=True)
        self._thread.start()

    @property
    def scheduled(self) -> int:
        """Batches asked for and not taken yet (collected, being collected or waiting)."""
        return len(self._pending)

    def request(self) -> None:
        """Ask for one more batch (started after those asked for before)."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the rollout pipeline is closed")
            self._pending.append(future)
            self._loop.call_soon_threadsafe(self._start, future)

    def take(self) -> T:
        """The oldest batch asked for, waiting until it is collected; its collection error is raised here."""
        if not self._pending:
            raise RuntimeError("take() with no batch asked for")
        future = self._pending.popleft()
        return future.result()

    def push_weights(self, push: Callable[[], T]) -> T:
        """Run `push` (the weight sync): at once with partial rollouts, else once the batch in collection ends."""
        if self.partial_rollout:
            return push()
        with self._batch_lock:
            return push()

    def close(self, wait_s: float = 30.0) -> None:
        """Cancel the batches not started and wait up to `wait_s` for those in collection (after a failure the
        rollout servers stop next, which ends them); then stop the loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for future in self._pending:
            future.cancel()  # a batch already in collection is not cancelled: it ends on its own
        drained = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
        try:
            drained.result(timeout=wait_s)
        except TimeoutError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    # ---- on the loop ---------------------------------------------------------------------------------
    def _start(self, future: Future[T]) -> None:
        task = self._loop.create_task(self._run(future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, future: Future[T]) -> None:
        async with self._slots:  # first come, first served: batches start in the order asked
            if not future.set_running_or_notify_cancel():
                return
            try:
                if self.partial_rollout:
                    result = await self._collect()
                else:
                    await asyncio.to_thread(self._batch_lock.acquire)
                    try:
                        result = await self._collect()
                    finally:
                        self._batch_lock.release()
            except BaseException as error:  # reaches the trainer through take()
                future.set_exception(error)
            else:
                future.set_result(result)

    async def _drain(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks))


def steps_to_request(
    step: int, total_steps: int, staleness: int, boundaries: Callable[[int], bool]
) -> list[int]:
    """The steps whose batches may be asked for once step `step` begins: up to `staleness` ahead, never past the
    first boundary step (a checkpoint or validation) at or after `step`."""
    last = min(total_steps, step + staleness)
    for candidate in range(step, last):
        if boundaries(candidate):
            return list(range(step + 1, candidate + 1)) if candidate > step else []
    return list(range(step + 1, last + 1))
