"""A bounded map that forgets its least recently used entries: the caches of rendered chat prompts and pictures."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class RecentMap:
    """At most `budget` of `weigh(value)` (one per entry by default), least recently used entries forgotten first
    (the newest is always kept). Safe from several threads or event loops (the engine's server routes, the pool's
    direct calls, the trainer); a value is made outside the lock, so two callers may both make it."""

    def __init__(self, budget: int, weigh: Callable[[Any], int] = lambda value: 1) -> None:
        self.budget = budget
        self.weigh = weigh
        self.entries: OrderedDict[Any, Any] = OrderedDict()
        self.used = 0
        self.hits = 0
        self._lock = threading.Lock()

    def get_or_make(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
                return self.entries[key]
        value = make()
        with self._lock:
            if key not in self.entries:
                self.entries[key] = value
                self.used += self.weigh(value)
            while self.used > self.budget and len(self.entries) > 1:
                self.used -= self.weigh(self.entries.popitem(last=False)[1])
        return value
