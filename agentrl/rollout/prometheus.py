"""The embedded engine's counters in Prometheus text format, under vLLM's metric names.

Dashboards and alerts built for vLLM servers read `GET /metrics` of an embedded server unchanged where the
meaning is shared: tokens in and out, prefix-cache queries and hits (in tokens, as vLLM counts them), running
and waiting requests, how full the KV cache is, and finished requests' time to first token, wait, prefill, decode
and whole latency as histograms (`engines/_latency.py`). Everything else the engine reports stays in the JSON of
`GET /stats`.
"""

from __future__ import annotations

from typing import Any

from agentrl.rollout.engines._latency import LATENCY_METRICS

# (vLLM's name, Prometheus type, help, the `EmbeddedEngine.stats()` key it reads)
VLLM_METRICS = (
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "tokens_generated"),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(stats: dict[str, Any], model_name: str) -> str:
    """The text exposition (format 0.0.4) of `stats`, each sample labelled with the served model's name."""
    model = f'model_name="{_label(model_name)}"'
    lines = []
    for name, kind, help_text, key in VLLM_METRICS:
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f"{name}{{{model}}} {float(stats.get(key, 0))}",
        ]
    latencies = stats.get("request_latency_seconds", {})
    for phase, (name, help_text, bounds) in LATENCY_METRICS.items():
        histogram = latencies.get(phase, {"buckets": [0] * (len(bounds) + 1), "sum": 0.0, "count": 0})
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip([*map(repr, bounds), "+Inf"], histogram["buckets"], strict=True):
            lines.append(f'{name}_bucket{{le="{bound}",{model}}} {float(count)}')
        lines += [
            f"{name}_sum{{{model}}} {float(histogram['sum'])}",
            f"{name}_count{{{model}}} {float(histogram['count'])}",
        ]
    return "\n".join(lines) + "\n"
