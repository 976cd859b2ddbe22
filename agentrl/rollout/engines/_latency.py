"""Each request's time to first token, wait, prefill, decode and whole latency, kept as histograms with vLLM's
names and bucket bounds (`GET /metrics`: `vllm:time_to_first_token_seconds` and the request phase histograms), so
a dashboard built for vLLM shows the embedded engine's latencies as it shows vLLM's.

The phases are measured inside the engine, from the request's arrival at the engine (after the server has read
and tokenized it) to the event that hands its tokens back. vLLM starts its clock earlier, when its API server
receives the request (its tokenizing included); neither counts the HTTP exchange a client's time to first token
also holds.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's bucket upper bounds (seconds) for the time to first token."""
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
"""vLLM's bucket upper bounds (seconds) for a request's phases and its whole latency."""

# phase -> (vLLM's name, help, bucket upper bounds)
LATENCY_METRICS = {
    "time_to_first_token": (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    "queue": (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "prefill": (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "decode": (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
}


class RequestLatencies:
    """Histograms of finished requests' phases (`LATENCY_METRICS`), written by the engine's thread and read by the
    server's (`snapshot`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {phase: [0] * (len(bounds) + 1) for phase, (_, _, bounds) in LATENCY_METRICS.items()}
        self._sums = dict.fromkeys(LATENCY_METRICS, 0.0)

    def finished(self, arrived: float, admitted: float, first_token: float, done: float) -> None:
        """Count one request that arrived, was admitted (its prefill began), drew its first token and finished at
        these `time.monotonic()` instants."""
        phases = {
            "time_to_first_token": first_token - arrived,
            "queue": admitted - arrived,
            "prefill": first_token - admitted,
            "decode": done - first_token,
            "e2e": done - arrived,
        }
        with self._lock:
            for phase, seconds in phases.items():
                bounds = LATENCY_METRICS[phase][2]
                self._counts[phase][bisect.bisect_left(bounds, seconds)] += 1
                self._sums[phase] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per phase: `buckets` (cumulative counts at each upper bound, then +Inf), `sum` and `count`."""
        with self._lock:
            counts = {phase: list(c) for phase, c in self._counts.items()}
            sums = dict(self._sums)
        out = {}
        for phase, per_bucket in counts.items():
            cumulative, total = [], 0
            for count in per_bucket:
                total += count
                cumulative.append(total)
            out[phase] = {"buckets": cumulative, "sum": sums[phase], "count": total}
        return out
