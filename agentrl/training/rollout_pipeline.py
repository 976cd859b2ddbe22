"""Rollouts collected ahead of training, in a background thread: the asynchronous loop's producer.

With `async_training.enable` and `staleness_threshold` N > 0, the episodes of step k+1..k+N are collected while
step k trains, one batch after another in one thread, and the trainer takes them in order. A batch is asked for
at most N steps ahead, so its tokens were sampled by weights at most N versions older than those it trains
(the bound every token's `policy_version` is checked against). After an update the new weights go to the engines
at once (`partial_rollout=true`: an episode in flight goes on with them, between two decode steps) or when the
batch being collected ends (`partial_rollout=false`: no batch mixes two versions; the push waits for it).

Nothing is asked for past the next checkpoint or validation step, so the pipeline is empty there: a checkpoint
holds exactly the batches trained, and the dataloader and collector state it saves are those of the last step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class RolloutPipeline(Generic[T]):
    """Runs `collect()` once per `request()`, in order, in one background thread; `take()` returns the results
    in the same order."""

    def __init__(self, collect: Callable[[], T], *, partial_rollout: bool) -> None:
        self._collect = collect
        self.partial_rollout = partial_rollout
        self._pending: deque[Future[T]] = deque()
        self._queue: deque[Future[T]] = deque()
        self._cond = threading.Condition()
        self._batch_lock = threading.Lock()  # held while a batch is collected
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rollout-pipeline", daemon=True)
        self._thread.start()

    @property
    def scheduled(self) -> int:
        """Batches asked for and not taken yet (collected, being collected or waiting)."""
        return len(self._pending)

    def request(self) -> None:
        """Ask for one more batch (collected after those asked for before)."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the rollout pipeline is closed")
            self._pending.append(future)
            self._queue.append(future)
            self._cond.notify()

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
        """Cancel the batches not started and wait up to `wait_s` for the one in collection (after a failure
        the rollout servers stop next, which ends it)."""
        with self._cond:
            self._closed = True
            for future in self._queue:
                future.cancel()
            self._queue.clear()
            self._cond.notify()
        self._thread.join(timeout=wait_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._batch_lock:
                    result = self._collect()
            except BaseException as error:  # reaches the trainer through take()
                future.set_exception(error)
            else:
                future.set_result(result)


def steps_to_request(
    step: int, total_steps: int, staleness: int, boundaries: Callable[[int], bool]
) -> list[int]:
    """The steps whose batches may be asked for while step `step` trains: up to `staleness` ahead, never past the
    first boundary step (a checkpoint or validation) at or after `step`."""
    last = min(total_steps, step + staleness)
    for candidate in range(step, last):
        if boundaries(candidate):
            return list(range(step + 1, candidate + 1)) if candidate > step else []
    return list(range(step + 1, last + 1))
