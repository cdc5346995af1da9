"""Serving metrics on synthetic timestamps with answers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from cobali.engine.outputs import RequestOutput, RequestStats
from cobali.engine.request import FinishReason
from cobali.harness.latency import (
    distribution,
    percentile_stats,
    request_timing,
    summarize,
    summarize_timings,
    timing_from_times,
)
from cobali.http.prometheus import BulkHistogram


def finished_request(prompt_len: int, token_times: list[float], arrival: float = 10.0,
                     scheduled: float = 10.5, error: str | None = None) -> RequestOutput:
    """A request's final output, ending with its last token."""
    n = len(token_times)
    stats = RequestStats(arrival, scheduled, tuple(token_times), token_times[-1], prompt_len, n, 0, 0)
    return RequestOutput(0, "", (5,) * n, n, (), True, prompt_len, 0, stats=stats, error=error,
                         finish_reason=FinishReason.ERROR if error else FinishReason.LENGTH)


def test_request_timing_from_known_timestamps() -> None:
    # Arrives at 10.0, scheduled at 10.5, tokens at 11.0, 11.1, 11.3, 11.6, finishes with the last token.
    t = request_timing(finished_request(3, [11.0, 11.1, 11.3, 11.6]).stats)
    assert t.ttft_ms == pytest.approx(1000.0)
    assert t.queue_ms == pytest.approx(500.0)
    assert t.itl_ms == pytest.approx((100.0, 200.0, 300.0))
    assert t.tpot_ms == pytest.approx(200.0)  # 600 ms over 3 gaps
    assert t.e2el_ms == pytest.approx(1600.0)


def test_one_token_has_ttft_but_no_tpot_or_itl() -> None:
    t = request_timing(finished_request(3, [10.25]).stats)
    assert t.ttft_ms == pytest.approx(250.0)
    assert t.tpot_ms is None and t.itl_ms == ()


def test_tpot_spreads_over_the_real_token_count_when_chunks_hold_several_tokens() -> None:
    # Two streamed chunks 300 ms apart that carried 4 tokens: 3 inter-token steps -> 100 ms each.
    t = timing_from_times(0.0, None, [0.5, 0.8], 0.9, n_tokens=4)
    assert t.tpot_ms == pytest.approx(100.0)
    assert t.itl_ms == pytest.approx((300.0,))  # ITL stays per chunk, as measured
    assert t.e2el_ms == pytest.approx(900.0) and t.queue_ms is None


def test_distribution_uses_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]
    d = distribution(values)
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "p50": None, "p99": None}


def test_percentile_stats() -> None:
    s = percentile_stats([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s == {"count": 5, "mean": 3.0, "p50": 3.0, "p75": 4.0, "p90": pytest.approx(4.6),
                 "p95": pytest.approx(4.8), "max": 5.0}
    empty = percentile_stats([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["max"] is None


def test_summarize_counts_throughput_and_pools_itl_across_requests() -> None:
    a = finished_request(3, [11.0, 11.1, 11.3])
    b = finished_request(5, [10.2, 10.6], arrival=10.0, scheduled=10.0)
    s = summarize([a, b], wall_s=2.0, user_cpu_s=1.0)
    assert (s["requests"], s["failed"], s["prompt_tokens"], s["generated_tokens"]) == (2, 0, 8, 5)
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["output_tok_s"] == pytest.approx(2.5)
    assert s["total_tok_s"] == pytest.approx(6.5)
    assert s["ttft_mean_ms"] == pytest.approx(600.0)  # (1000 + 200) / 2
    assert s["itl_mean_ms"] == pytest.approx(700.0 / 3)  # 100, 200, 400 pooled
    assert s["itl_p50_ms"] == pytest.approx(200.0)


def test_summarize_equals_summarize_timings_over_request_timings() -> None:
    requests = [finished_request(3, [11.0, 11.1, 11.3]), finished_request(2, [10.4], error="boom")]
    direct = summarize(requests, wall_s=1.5, user_cpu_s=0.5)
    via = summarize_timings([request_timing(r.stats) for r in requests], prompt_tokens=5, generated_tokens=4,
                            failed=1, wall_s=1.5, user_cpu_s=0.5)
    assert direct == {**via, "preemptions": 0, "cached_tokens": 0}
    assert direct["failed"] == 1


def test_the_bulk_histogram_exposes_what_prometheus_histogram_does() -> None:
    values = [0.0005, 0.001, 0.003, 0.005, 0.0051, 0.2, 3.0, 500.0]  # on bounds, between, below and above all
    buckets = (0.001, 0.005, 0.25, 5.0)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("gaps", "Gaps.", buckets=buckets, registry=theirs)
    for value in values:
        histogram.observe(value)
    bulk = BulkHistogram("gaps", "Gaps.", buckets, ours)
    bulk.observe_many(np.array(values[:3]))
    bulk.observe_many(np.array(values[3:]))
    assert generate_latest(ours) == generate_latest(theirs)
