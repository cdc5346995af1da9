"""Serving metrics from request timestamps: TTFT, TPOT, ITL, E2EL, their percentiles, and a run's summary."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cobali.engine.outputs import RequestOutput, RequestStats

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """One request's latencies in milliseconds (None where undefined, e.g. TPOT of a 1-token output)."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None
    queue_ms: float | None
    itl_ms: tuple[float, ...]


def request_timing(stats: RequestStats, with_itl: bool = True) -> RequestTiming:
    return timing_from_times(stats.arrival_time, stats.first_scheduled_time, stats.token_times, stats.finish_time,
                             with_itl=with_itl)


def timing_from_times(arrival: float, first_scheduled: float | None, token_times: Sequence[float],
                      finish: float | None, n_tokens: int | None = None, with_itl: bool = True) -> RequestTiming:
    """Latencies from raw timestamps (seconds). `n_tokens` is the output length when it exceeds the
    number of timestamps, as for a streaming client that gets several tokens in one chunk; TPOT then
    spreads the time after the first token over the real count. with_itl=False leaves itl_ms empty (a log
    line reads none of it)."""
    times = token_times
    n = max(n_tokens or 0, len(times))
    ttft = (times[0] - arrival) * 1e3 if times else None
    tpot = (times[-1] - times[0]) * 1e3 / (n - 1) if len(times) > 1 else None
    e2el = (finish - arrival) * 1e3 if finish is not None else None
    queue = (first_scheduled - arrival) * 1e3 if first_scheduled is not None else None
    itl = tuple((np.diff(times) * 1e3).tolist()) if with_itl and len(times) > 1 else ()
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


def summarize(outputs: Sequence[RequestOutput], wall_s: float, user_cpu_s: float) -> dict:
    """The run's summary from its requests' final outputs: counts, throughput, latency distributions (ms), and
    what the engine did for them (preemptions, prompt tokens served from the prefix cache)."""
    stats = [final_stats(o) for o in outputs]
    summary = summarize_timings(
        [request_timing(s) for s in stats],
        prompt_tokens=sum(s.n_prompt_tokens for s in stats),
        generated_tokens=sum(s.n_output_tokens for s in stats),
        failed=sum(o.error is not None for o in outputs),
        wall_s=wall_s,
        user_cpu_s=user_cpu_s,
    )
    summary["preemptions"] = sum(s.preemptions for s in stats)
    summary["cached_tokens"] = sum(s.cached_tokens for s in stats)
    return summary


def final_stats(output: RequestOutput) -> RequestStats:
    assert output.stats is not None, f"request {output.request_id}: not a final output"
    return output.stats


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


def request_record(output: RequestOutput) -> dict:
    """A request's whole final output (LLM's), as a report's record."""
    stats = final_stats(output)
    timing = request_timing(stats)
    return {
        "id": output.request_id,
        "prompt_tokens": stats.n_prompt_tokens,
        "output_tokens": stats.n_output_tokens,
        "cached_tokens": stats.cached_tokens,
        "preemptions": stats.preemptions,
        "text": output.text,
        "finish_reason": output.finish_reason.value if output.finish_reason else None,
        "error": output.error,
        "ttft_ms": timing.ttft_ms,
        "tpot_ms": timing.tpot_ms,
        "e2el_ms": timing.e2el_ms,
        "queue_ms": timing.queue_ms,
        "itl_ms": list(timing.itl_ms),
    }


def format_summary(summary: dict) -> str:
    lines = [
        f"requests            {summary['requests']} ({summary['failed']} failed)",
        f"prompt tokens       {summary['prompt_tokens']}",
        f"generated tokens    {summary['generated_tokens']}",
        f"wall time           {summary['wall_s']:.2f} s",
        f"user CPU time       {summary['user_cpu_s']:.2f} s",
        f"throughput          {summary['requests_per_s']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s, "
        f"{summary['total_tok_s']:.1f} total tok/s",
    ]
    if "preemptions" in summary:
        lines.append(f"engine              {summary['preemptions']} preemptions, {summary['cached_tokens']} prompt "
                     "tokens from the prefix cache")
    if summary.get("ticks"):
        lines.append(f"ticks               {summary['ticks']} (mean {summary['mean_batch_tokens']:.1f} tok/batch, "
                     f"host {summary['host_ms_per_tick']:.2f} ms/tick = {summary['host_share']:.1%}, "
                     f"wasted decode slots {summary['wasted_decode_slots']})")
    lines.append(f"{'latency (ms)':<20}{'mean':>10}{'p50':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        cells = [summary[f"{name}_{stat}_ms"] for stat in ("mean", "p50", "p99")]
        lines.append(f"{name.upper():<20}" + "".join(f"{c:>10.1f}" if c is not None else f"{'-':>10}" for c in cells))
    return "\n".join(lines)


def write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path
