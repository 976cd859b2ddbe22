"""Finished requests' latencies (`engines/_latency.py`) in vLLM's buckets, and as Prometheus histograms on
`GET /metrics` (`prometheus.py`)."""

from agentrl.rollout.engines._latency import LATENCY_METRICS, TIME_TO_FIRST_TOKEN_BUCKETS, RequestLatencies
from agentrl.rollout.prometheus import render_prometheus
from tests._prometheus import prometheus_samples as _samples


def test_latencies_fall_in_vllms_buckets_and_render_as_prometheus_histograms():
    latencies = RequestLatencies()
    latencies.finished(arrived=0.0, admitted=0.002, first_token=0.005, done=0.5)  # first token on a bound
    latencies.finished(arrived=0.0, admitted=1.0, first_token=3.0, done=8000.0)  # whole latency past the last
    snapshot = latencies.snapshot()
    ttft = snapshot["time_to_first_token"]
    assert ttft["count"] == 2 and ttft["sum"] == 3.005
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(0.005)] == 1  # a bound counts in its own bucket
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(2.5)] == 1
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(5.0)] == 2
    assert snapshot["e2e"]["buckets"][-2:] == [1, 2]  # 8,000 s only under +Inf
    assert snapshot["queue"]["sum"] + snapshot["prefill"]["sum"] == ttft["sum"]

    samples = _samples(render_prometheus({"request_latency_seconds": snapshot}, 'm"1'))
    label = 'model_name="m\\"1"'
    for phase, (name, _, bounds) in LATENCY_METRICS.items():
        buckets = [samples[f'{name}_bucket{{le="{b}",{label}}}'] for b in [*map(repr, bounds), "+Inf"]]
        assert buckets == [float(c) for c in snapshot[phase]["buckets"]]
        assert samples[f"{name}_count{{{label}}}"] == 2.0
        assert samples[f"{name}_sum{{{label}}}"] == snapshot[phase]["sum"]
    assert samples[f'vllm:time_to_first_token_seconds_bucket{{le="0.001",{label}}}'] == 0.0


def test_an_engine_that_finished_nothing_renders_empty_histograms():
    samples = _samples(render_prometheus({}, "m"))
    assert samples['vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"}'] == 0.0
    assert samples['vllm:time_to_first_token_seconds_count{model_name="m"}'] == 0.0
