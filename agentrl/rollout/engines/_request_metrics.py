"""What vLLM's `GET /metrics` tells about requests, kept by the embedded engine under vLLM's names and bucket
bounds, so a dashboard built for vLLM (its Grafana board: latencies, token throughput, prompt and generation
lengths, finish reasons) shows the embedded engine as it shows vLLM:

- each request's time to first token, wait, prefill, decode and whole latency (a request of `n` completions
  counted once, when the last finishes);
- the time between a completion's consecutive tokens (`vllm:inter_token_latency_seconds`, one sample a token
  after the first) and each completion's mean of it (`vllm:request_time_per_output_token_seconds`);
- each completion's prompt and generated tokens, its `max_tokens`, and how it ended (`vllm:request_success_total`
  by `finished_reason`: stop, length, abort when its client left, error when a step failed), a completion
  counted as vLLM counts it (vLLM runs a request of `n` as `n` requests); and per request its `n` and the most
  tokens one of its completions generated (`vllm:request_max_num_generation_tokens`).

Times are measured inside the engine, from the request's arrival at the engine (after the server has read and
tokenized it) to the event that hands its tokens back. vLLM starts its clock earlier, when its API server
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
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's bucket upper bounds (seconds) between two tokens."""
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
"""vLLM's bucket upper bounds for a request's `n`."""
FINISH_REASONS = ("stop", "length", "abort", "error")
"""The `finished_reason` labels of `vllm:request_success_total` the engine can give."""

# key -> (vLLM's name, help, bucket upper bounds; None: `token_count_buckets` of the engine's max_model_len)
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
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
    "inter_token": (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    "time_per_output_token": (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    "generation_tokens": ("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    "max_tokens": ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
    "most_generated": (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        None,
    ),
    "n": ("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
}
PHASES = ("time_to_first_token", "queue", "prefill", "decode", "e2e")
"""The histograms of a request's phases (`RequestMetrics.finished_request`)."""


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's bounds for a request's token counts: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        # a value on a bound counts in that bound's bucket (Prometheus buckets are `le`)
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def snapshot(self) -> dict[str, Any]:
        cumulative, count = [], 0
        for n in self.counts:
            count += n
            cumulative.append(count)
        return {"bounds": list(self.bounds), "buckets": cumulative, "sum": self.total, "count": count}


class RequestMetrics:
    """The histograms (`HISTOGRAMS`) and finish counts, written by the engine's thread and read by the server's
    (`snapshot`)."""

    def __init__(self, max_model_len: int) -> None:
        self._lock = threading.Lock()
        tokens = token_count_buckets(max_model_len)
        self._histograms = {key: _Histogram(bounds or tokens) for key, (_, _, bounds) in HISTOGRAMS.items()}
        self._finished = dict.fromkeys(FINISH_REASONS, 0)

    def finished_request(
        self,
        arrived: float,
        admitted: float,
        first_token: float,
        done: float,
        n: int = 1,
        most_generated: int = 0,
    ) -> None:
        """Count one request of `n` completions that arrived, was admitted (its prefill began), drew its first
        token and finished at these `time.monotonic()` instants, its longest completion `most_generated` tokens."""
        phases = (
            first_token - arrived,
            admitted - arrived,
            first_token - admitted,
            done - first_token,
            done - arrived,
        )
        with self._lock:
            for key, seconds in zip(PHASES, phases, strict=True):
                self._histograms[key].observe(seconds)
            self._histograms["n"].observe(n)
            self._histograms["most_generated"].observe(most_generated)

    def finished_completion(
        self,
        reason: str,
        prompt_tokens: int,
        generated: int,
        first_token: float | None,
        done: float,
        max_tokens: int | None = None,
    ) -> None:
        """Count one completion that ended for `reason` (`FINISH_REASONS`) after `generated` tokens of at most
        `max_tokens`, the first at `first_token` (None: it drew none), the last at `done`."""
        decode = done - first_token if first_token is not None else 0.0
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            self._histograms["prompt_tokens"].observe(prompt_tokens)
            self._histograms["generation_tokens"].observe(generated)
            if max_tokens:
                self._histograms["max_tokens"].observe(max_tokens)
            # vLLM's mean: decode time over the tokens after the first (0 for a completion of one token)
            self._histograms["time_per_output_token"].observe(
                decode / (generated - 1) if generated > 1 else 0.0
            )

    def tokens_apart(self, gaps: dict[float, int]) -> None:
        """Count tokens that came `seconds` after their completion's previous token: {seconds: tokens}."""
        with self._lock:
            for seconds, tokens in gaps.items():
                self._histograms["inter_token"].observe(seconds, tokens)

    def snapshot(self) -> dict[str, Any]:
        """{"histograms": per `HISTOGRAMS` key its `bounds`, `buckets` (cumulative counts at each bound, then
        +Inf), `sum` and `count`; "finished": completions per finish reason}."""
        with self._lock:
            return {
                "histograms": {key: histogram.snapshot() for key, histogram in self._histograms.items()},
                "finished": dict(self._finished),
            }
