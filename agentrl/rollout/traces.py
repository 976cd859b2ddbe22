"""TraceStore: the gateway's record of sessions and of every model call made under them.

The gateway writes here (from its event loop) and the trainer reads here (from the controller's
thread) when both live in one process; `GET /sessions/{id}/traces` serves the same data over HTTP.
One lock guards everything, so a reader never sees a half-registered session or a torn list.
"""

from __future__ import annotations

import threading
import uuid
from typing import Literal

from agentrl.types import Trace

SamplingMode = Literal["train", "validation"]
SAMPLING_MODES: tuple[str, ...] = ("train", "validation")
_MODE_ALIASES = {"train": "train", "validation": "validation", "val": "validation", "eval": "validation"}


class UnknownSessionError(KeyError):
    """The session id was never opened (or was closed)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"unknown session {self.session_id!r}: open it first (POST /sessions or Gateway.open_session)"


def normalize_mode(mode: str) -> SamplingMode:
    """'train' or 'validation' (accepts 'val'/'eval'); ValueError naming the allowed values."""
    try:
        return _MODE_ALIASES[mode]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"mode must be one of {list(SAMPLING_MODES)}, got {mode!r}") from None


class TraceStore:
    """Sessions (id -> sampling mode) and their traces, in call order. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, SamplingMode] = {}
        self._traces: dict[str, list[Trace]] = {}
        self._max_calls: dict[str, int | None] = {}
        self._calls: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._refused_prompts: dict[str, int] = {}

    def open_session(
        self, session_id: str | None = None, mode: str = "train", max_calls: int | None = None
    ) -> str:
        """Register a session (a fresh id when none is given); reopening keeps its traces.

        `max_calls` caps the model calls the session may make (`agent.max_steps`); None means no cap.
        """
        sid = session_id or uuid.uuid4().hex
        if "/" in sid or not sid.strip():
            raise ValueError(f"session id must be a non-empty string without '/', got {sid!r}")
        normalized = normalize_mode(mode)
        with self._lock:
            self._modes[sid] = normalized
            self._traces.setdefault(sid, [])
            self._max_calls[sid] = max_calls
            self._calls.setdefault(sid, 0)
            self._refused.setdefault(sid, 0)
            self._refused_prompts.setdefault(sid, 0)
        return sid

    def close_session(self, session_id: str) -> None:
        """Forget the session and its traces (no error if it is already gone)."""
        with self._lock:
            tables = (
                self._modes,
                self._traces,
                self._max_calls,
                self._calls,
                self._refused,
                self._refused_prompts,
            )
            for table in tables:
                table.pop(session_id, None)

    def begin_call(self, session_id: str) -> bool:
        """Count one model call of the session; False (and counted as refused) once over its cap."""
        with self._lock:
            if session_id not in self._modes:
                raise UnknownSessionError(session_id)
            cap = self._max_calls.get(session_id)
            if cap is not None and self._calls[session_id] >= cap:
                self._refused[session_id] += 1
                return False
            self._calls[session_id] += 1
            return True

    def call_count(self, session_id: str) -> int:
        """Model calls the session has made so far (refused ones not counted)."""
        with self._lock:
            return self._calls.get(session_id, 0)

    def refused_calls(self, session_id: str) -> int:
        """Calls refused because the session reached its cap (0 for unknown sessions)."""
        with self._lock:
            return self._refused.get(session_id, 0)

    def refuse_prompt(self, session_id: str) -> None:
        """Count a call refused because its prompt was over the limit (`data.max_prompt_length`)."""
        with self._lock:
            if session_id in self._refused_prompts:
                self._refused_prompts[session_id] += 1

    def refused_prompts(self, session_id: str) -> int:
        """Calls refused because their prompt was too long (0 for unknown sessions)."""
        with self._lock:
            return self._refused_prompts.get(session_id, 0)

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._modes

    def mode(self, session_id: str) -> SamplingMode:
        """The session's sampling mode; UnknownSessionError if it is not open."""
        with self._lock:
            if session_id not in self._modes:
                raise UnknownSessionError(session_id)
            return self._modes[session_id]

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._modes)

    def add(self, trace: Trace) -> None:
        """Append a trace to its session; UnknownSessionError if the session was closed meanwhile."""
        with self._lock:
            if trace.session_id not in self._traces:
                raise UnknownSessionError(trace.session_id)
            self._traces[trace.session_id].append(trace)

    def traces(self, session_id: str) -> list[Trace]:
        """A copy of the session's traces in call order; UnknownSessionError if it is not open."""
        with self._lock:
            if session_id not in self._traces:
                raise UnknownSessionError(session_id)
            return list(self._traces[session_id])

    def clear(self, session_id: str) -> None:
        """Drop the session's traces but keep the session open."""
        with self._lock:
            if session_id not in self._traces:
                raise UnknownSessionError(session_id)
            self._traces[session_id] = []
