"""The embedded engine's counters in Prometheus text format, under vLLM's metric names.

Dashboards and alerts built for vLLM servers read `GET /metrics` of an embedded server unchanged where the
meaning is shared: tokens in and out, prefix-cache queries and hits (in tokens, as vLLM counts them), running
and waiting requests, how full the KV cache is, and finished requests' latencies, token counts and finish
reasons (`engines/_request_metrics.py`). Everything else the engine reports stays in the JSON of `GET /stats`.
"""

from __future__ import annotations

from typing import Any

from agentrl.rollout.engines._request_metrics import FINISH_REASONS, HISTOGRAMS

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
    requests = stats.get("request_metrics", {})
    finished = requests.get("finished", {})
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter"]
    for reason in FINISH_REASONS:
        lines.append(f'{name}{{finished_reason="{reason}",{model}}} {float(finished.get(reason, 0))}')
    for key, histogram in requests.get("histograms", {}).items():
        name, help_text, _ = HISTOGRAMS[key]
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        uppers = [*(repr(float(bound)) for bound in histogram["bounds"]), "+Inf"]
        for upper, count in zip(uppers, histogram["buckets"], strict=True):
            lines.append(f'{name}_bucket{{le="{upper}",{model}}} {float(count)}')
        lines += [
            f"{name}_sum{{{model}}} {float(histogram['sum'])}",
            f"{name}_count{{{model}}} {float(histogram['count'])}",
        ]
    return "\n".join(lines) + "\n"
