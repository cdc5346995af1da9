"""Serving metrics from request timestamps: TTFT, TPOT, ITL, E2EL and their percentiles."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cobali.engine.request import Request

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """One request's latencies in milliseconds (None where undefined, e.g. TPOT of a 1-token output)."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None
    queue_ms: float | None
    itl_ms: tuple[float, ...]


def request_timing(request: Request) -> RequestTiming:
    times = request.token_times
    arrival = request.arrival_time
    ttft = (times[0] - arrival) * 1e3 if times else None
    tpot = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else None
    e2el = (request.finish_time - arrival) * 1e3 if request.finish_time is not None else None
    queue = (request.first_scheduled_time - arrival) * 1e3 if request.first_scheduled_time is not None else None
    itl = tuple(float(d) * 1e3 for d in np.diff(times)) if len(times) > 1 else ()
    return RequestTiming(ttft, tpot, e2el, queue, itl)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p99 (linear interpolation, as numpy and vLLM's benchmark do); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def latency_samples(timings: Iterable[RequestTiming]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for t in timings:
        for name, value in (("ttft", t.ttft_ms), ("tpot", t.tpot_ms), ("e2el", t.e2el_ms)):
            if value is not None:
                samples[name].append(value)
        samples["itl"].extend(t.itl_ms)
    return samples


def summarize(requests: Sequence[Request], wall_s: float, user_cpu_s: float) -> dict:
    """The run's summary: counts, throughput and latency distributions (ms)."""
    prompt = sum(len(r.prompt_tokens) for r in requests)
    generated = sum(len(r.output_tokens) for r in requests)
    failed = sum(r.error is not None for r in requests)
    samples = latency_samples(request_timing(r) for r in requests)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    summary = {
        "requests": len(requests),
        "failed": failed,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "wall_s": wall_s,
        "user_cpu_s": user_cpu_s,
        "requests_per_s": per_s(len(requests)),
        "output_tok_s": per_s(generated),
        "total_tok_s": per_s(prompt + generated),
    }
    for name in LATENCIES:
        for stat, value in distribution(samples[name]).items():
            summary[f"{name}_{stat}_ms"] = value
    return summary
