"""What failed since the last console line: flow errors, flow timeouts and evaluator errors, each with its first
reason, so that a step whose rollouts all failed says why on the console instead of only "no trainable rows".

The collector and the evaluator record (`record_failure`) where the failure happens; the console drains once
per step (`drain_failures`) and prints `format_failure_line`. One tally per process, like a logger: neither side
needs to know the other. Counts cover every episode since the previous line, validation included.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["FAILURE_KINDS", "FailureCounts", "drain_failures", "format_failure_line", "record_failure"]

FAILURE_KINDS = ("flow_error", "timeout", "evaluator_error")
"""What is counted: a flow that raised, a rollout past `agent.timeout`, an evaluator that raised or returned
something that is no reward (NaN, a string)."""
_LABELS = {"flow_error": "flow error", "timeout": "timeout", "evaluator_error": "evaluator error"}
_REASON_CHARS = 200


@dataclass
class FailureCounts:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    first: dict[str, str] = field(default_factory=dict)
    """The first reason of each kind: the last line of its error text (an exception's type and message)."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())


_lock = threading.Lock()
_tally = FailureCounts()


def record_failure(kind: str, error: str | None) -> None:
    """Count one failed episode of `kind` (one of `FAILURE_KINDS`); `error` is its error text or traceback."""
    if kind not in FAILURE_KINDS:
        raise ValueError(f"failure kind must be one of {FAILURE_KINDS}, got {kind!r}")
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    reason = (lines[-1] if lines else "no reason given")[:_REASON_CHARS]
    with _lock:
        _tally.counts[kind] += 1
        _tally.first.setdefault(kind, reason)


def drain_failures() -> FailureCounts:
    """The failures recorded since the last drain; the tally starts again from zero."""
    global _tally
    with _lock:
        drained, _tally = _tally, FailureCounts()
    return drained


def format_failure_line(failures: FailureCounts, step: int) -> str | None:
    """`step 3 | failed rollouts: 2 flow errors, 1 timeout, 0 evaluator errors | first flow error: ...`, or None
    when nothing failed."""
    if not failures.total:
        return None
    counts = ", ".join(f"{n} {_LABELS[kind]}{'' if n == 1 else 's'}" for kind, n in failures.counts.items())
    firsts = [
        f"first {_LABELS[kind]}: {failures.first[kind]}" for kind in FAILURE_KINDS if kind in failures.first
    ]
    return " | ".join([f"step {step}", f"failed rollouts: {counts}", *firsts])
