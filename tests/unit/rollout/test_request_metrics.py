"""Finished requests' latencies, token counts and finish reasons (`engines/_request_metrics.py`) in vLLM's buckets,
and as Prometheus samples on `GET /metrics` (`prometheus.py`)."""

import pytest

from agentrl.rollout.engines._request_metrics import (
    FINISH_REASONS,
    HISTOGRAMS,
    INTER_TOKEN_LATENCY_BUCKETS,
    PHASES,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    RequestMetrics,
    token_count_buckets,
)
from agentrl.rollout.prometheus import render_prometheus
from tests._prometheus import prometheus_samples as _samples


def _rendered(metrics: RequestMetrics, model: str = "m") -> dict[str, float]:
    return _samples(render_prometheus({"request_metrics": metrics.snapshot()}, model))


def test_latencies_fall_in_vllms_buckets_and_render_as_prometheus_histograms():
    metrics = RequestMetrics(max_model_len=256)
    metrics.finished_request(
        arrived=0.0, admitted=0.002, first_token=0.005, done=0.5
    )  # first token on a bound
    metrics.finished_request(
        arrived=0.0, admitted=1.0, first_token=3.0, done=8000.0
    )  # whole latency past the last
    snapshot = metrics.snapshot()["histograms"]
    ttft = snapshot["time_to_first_token"]
    assert ttft["count"] == 2 and ttft["sum"] == 3.005
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(0.005)] == 1  # a bound counts in its own bucket
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(2.5)] == 1
    assert ttft["buckets"][TIME_TO_FIRST_TOKEN_BUCKETS.index(5.0)] == 2
    assert snapshot["e2e"]["buckets"][-2:] == [1, 2]  # 8,000 s only under +Inf
    assert snapshot["queue"]["sum"] + snapshot["prefill"]["sum"] == ttft["sum"]

    samples = _rendered(metrics, 'm"1')
    label = 'model_name="m\\"1"'
    for phase in PHASES:
        name, _, bounds = HISTOGRAMS[phase]
        uppers = [*(repr(float(b)) for b in bounds), "+Inf"]
        buckets = [samples[f'{name}_bucket{{le="{upper}",{label}}}'] for upper in uppers]
        assert buckets == [float(c) for c in snapshot[phase]["buckets"]]
        assert samples[f"{name}_count{{{label}}}"] == 2.0
        assert samples[f"{name}_sum{{{label}}}"] == snapshot[phase]["sum"]
    assert samples[f'vllm:time_to_first_token_seconds_bucket{{le="0.001",{label}}}'] == 0.0


def test_token_counts_take_vllms_one_two_five_bounds_up_to_max_model_len():
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    metrics = RequestMetrics(max_model_len=100)
    metrics.finished_completion("length", prompt_tokens=90, generated=10, first_token=1.0, done=1.9)
    prompt = metrics.snapshot()["histograms"]["prompt_tokens"]
    assert prompt["bounds"] == [1, 2, 5, 10, 20, 50, 100] and prompt["buckets"] == [0, 0, 0, 0, 0, 0, 1, 1]
    samples = _rendered(metrics)
    assert samples['vllm:request_prompt_tokens_bucket{le="50.0",model_name="m"}'] == 0.0
    assert samples['vllm:request_prompt_tokens_bucket{le="100.0",model_name="m"}'] == 1.0
    assert samples['vllm:request_generation_tokens_sum{model_name="m"}'] == 10.0


def test_completions_are_counted_by_finish_reason_with_their_mean_time_per_token():
    metrics = RequestMetrics(max_model_len=512)
    metrics.finished_completion("stop", prompt_tokens=20, generated=5, first_token=1.0, done=1.2)
    metrics.finished_completion("length", prompt_tokens=20, generated=1, first_token=1.0, done=1.0)
    metrics.finished_completion("abort", prompt_tokens=30, generated=0, first_token=None, done=4.0)
    metrics.finished_completion(
        "stop", prompt_tokens=20, generated=3, first_token=2.0, done=2.5, max_tokens=64
    )
    metrics.finished_request(arrived=0.0, admitted=0.5, first_token=1.0, done=2.5, n=2, most_generated=5)
    snapshot = metrics.snapshot()
    assert (
        snapshot["histograms"]["max_tokens"]["count"] == 1
        and snapshot["histograms"]["max_tokens"]["sum"] == 64
    )
    assert snapshot["histograms"]["n"]["buckets"][:2] == [0, 1]  # n = 2 on its own bound
    assert snapshot["histograms"]["most_generated"]["sum"] == 5
    assert snapshot["finished"] == {"stop": 2, "length": 1, "abort": 1, "error": 0}
    per_token = snapshot["histograms"]["time_per_output_token"]
    # (1.2 - 1.0) / 4 and (2.5 - 2.0) / 2; a completion of one token or none counts 0, as vLLM's does
    assert per_token["count"] == 4 and per_token["sum"] == pytest.approx(0.05 + 0.25)
    assert snapshot["histograms"]["prompt_tokens"]["sum"] == 90
    samples = _rendered(metrics)
    for reason in FINISH_REASONS:
        key = f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}}'
        assert samples[key] == snapshot["finished"][reason]


def test_inter_token_latencies_count_each_token_after_a_completions_first():
    metrics = RequestMetrics(max_model_len=512)
    metrics.tokens_apart({0.02: 30, 0.3: 2})
    metrics.tokens_apart({0.01: 1})
    itl = metrics.snapshot()["histograms"]["inter_token"]
    assert itl["count"] == 33 and itl["sum"] == pytest.approx(30 * 0.02 + 2 * 0.3 + 0.01)
    assert itl["buckets"][INTER_TOKEN_LATENCY_BUCKETS.index(0.01)] == 1
    assert itl["buckets"][INTER_TOKEN_LATENCY_BUCKETS.index(0.025)] == 31


def test_an_engine_that_finished_nothing_renders_every_metric_at_zero():
    samples = _rendered(RequestMetrics(max_model_len=64))
    assert samples['vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"}'] == 0.0
    assert samples['vllm:time_to_first_token_seconds_count{model_name="m"}'] == 0.0
    assert samples['vllm:request_generation_tokens_bucket{le="50.0",model_name="m"}'] == 0.0
    assert samples['vllm:request_success_total{finished_reason="stop",model_name="m"}'] == 0.0
