"""Worker groups: where workers live. The controller calls worker methods by name through one interface.

`local` keeps the workers in the controller process (one device; the embedded default). The `ray` backend
(one Ray actor per device with FSDP2 across them) plugs in behind the same `call`, so the controller's code
does not change with where its workers run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class WorkerGroup(ABC):
    """A set of identical workers; `call` runs one of their methods on each and returns the results."""

    @abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `worker.<method>(*args, **kwargs)` on every worker, in rank order."""

    def call_first(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method on every worker and return rank 0's result (what data-parallel methods agree on)."""
        return self.call(method, *args, **kwargs)[0]

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold."""


class LocalWorkerGroup(WorkerGroup):
    """One worker in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()


def build_worker_group(backend: str, worker_cls: type, **kwargs: Any) -> WorkerGroup:
    """A worker group of `worker_cls(**kwargs)` on `trainer.backend`."""
    if backend == "local":
        return LocalWorkerGroup(worker_cls(**kwargs))
    raise ValueError(
        f"trainer.backend={backend!r} is not available in this version; use trainer.backend=local"
    )
