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
    return timing_from_times(request.arrival_time, request.first_scheduled_time, request.token_times,
                             request.finish_time)


def timing_from_times(arrival: float, first_scheduled: float | None, token_times: Sequence[float],
                      finish: float | None, n_tokens: int | None = None) -> RequestTiming:
    """Latencies from raw timestamps (seconds). `n_tokens` is the output length when it exceeds the
    number of timestamps, as for a streaming client that gets several tokens in one chunk; TPOT then
    spreads the time after the first token over the real count."""
    times = token_times
    n = max(n_tokens or 0, len(times))
    ttft = (times[0] - arrival) * 1e3 if times else None
    tpot = (times[-1] - times[0]) * 1e3 / (n - 1) if len(times) > 1 else None
    e2el = (finish - arrival) * 1e3 if finish is not None else None
    queue = (first_scheduled - arrival) * 1e3 if first_scheduled is not None else None
    itl = tuple(float(d) * 1e3 for d in np.diff(times)) if len(times) > 1 else ()
    return RequestTiming(ttft, tpot, e2el, queue, itl)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p99 (linear interpolation, as numpy and vLLM's benchmark do); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99))}


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
    return summarize_timings(
        [request_timing(r) for r in requests],
        prompt_tokens=sum(len(r.prompt_tokens) for r in requests),
        generated_tokens=sum(len(r.output_tokens) for r in requests),
        failed=sum(r.error is not None for r in requests),
        wall_s=wall_s,
        user_cpu_s=user_cpu_s,
    )


def summarize_timings(timings: Sequence[RequestTiming], prompt_tokens: int, generated_tokens: int,
                      failed: int, wall_s: float, user_cpu_s: float) -> dict:
    """summarize() for timings measured anywhere (in the engine, or by a client over HTTP)."""
    samples = latency_samples(timings)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    summary = {
        "requests": len(timings),
        "failed": failed,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "wall_s": wall_s,
        "user_cpu_s": user_cpu_s,
        "requests_per_s": per_s(len(timings)),
        "output_tok_s": per_s(generated_tokens),
        "total_tok_s": per_s(prompt_tokens + generated_tokens),
    }
    for name in LATENCIES:
        for stat, value in distribution(samples[name]).items():
            summary[f"{name}_{stat}_ms"] = value
    return summary


def percentile_stats(values: Sequence[float], percentiles: Sequence[int] = (50, 75, 90, 95)) -> dict:
    """count, mean, the given percentiles and max; the values' unit is kept (None stats when empty)."""
    arr = np.asarray(values, dtype=np.float64)
    stats: dict[str, float | int | None] = {"count": int(arr.size)}
    stats["mean"] = float(arr.mean()) if arr.size else None
    for q in percentiles:
        stats[f"p{q}"] = float(np.percentile(arr, q)) if arr.size else None
    stats["max"] = float(arr.max()) if arr.size else None
    return stats
